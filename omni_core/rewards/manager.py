"""Score a batch of generated images: which reward functions run, and how failures are reported.

Built from the ``reward`` config section (duck-typed attributes or a mapping), which selects one of
three modes, first match wins:

1. ``reward.reward_functions`` non-empty -> **weighted sum**. Each entry is a built-in name
   (``"jpeg_compressibility"``, weight 1.0) or a mapping ``{name: <built-in>, weight: w}`` or
   ``{path: <file.py>, function: <fn, default compute_score>, name: <label>, weight: w}``.
   The score is ``sum_k w_k * s_k``; each term's raw score is kept in the extras under its label
   (and a term's own extras as ``<label>/<key>``). ``reward.aggregation`` must be ``weighted_sum``.
   verl-omni's mapping form ``{label: {path, name: <function>, weight}}`` is accepted too.
2. ``reward.custom_reward_function.path`` set -> that file's ``custom_reward_function.name``
   (default ``compute_score``), verl-omni's contract
   ``compute_score(data_source, solution_image, ground_truth, extra_info) -> float | {"score": ...}``.
3. Otherwise -> each sample's ``data_source`` names the built-in reward to use
   (verl-omni's ``default_compute_score``); a data source without a built-in is a config error,
   raised before any scoring.

A reward that raises, returns NaN / inf, or returns something that is not a number marks only that
sample as failed (score NaN, ``failed`` True, reason ``"<label>: <ExcType>: <message>"``); it never
becomes a silent 0 and never stops the rest of the batch. A call that takes longer than
``reward.timeout_s`` fails its sample with ``"timed out after N s"`` (see ``deadline`` for what happens
to the hung call) and the term's remaining samples of that batch fail without a call, so a hung reward
costs one timeout per batch. The trainer decides what failed samples mean (``failures``: advantage 0
below ``reward.max_failure_ratio``, a ``RewardFailureError`` above it).
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from omni_core.config.schema import reward_entries_from_verl_mapping
from omni_core.rewards.custom import DEFAULT_FUNCTION_NAME, load_reward_function
from omni_core.rewards.deadline import DeadlineRunner, RewardTimeout
from omni_core.rewards.failures import RewardFailureError
from omni_core.rewards.registry import REWARD_FUNCTIONS, get_reward_function

__all__ = ["RewardFailureError", "RewardManager", "RewardResult", "RewardTerm"]

logger = logging.getLogger(__name__)

ScoreFn = Callable[[str, Any, Any, dict[str, Any]], Any]


@dataclass
class RewardResult:
    """Per-sample outcome of :meth:`RewardManager.score` for a batch of ``B`` images.

    Attributes:
        scores: ``[B]`` float32; NaN where the sample failed.
        extras: ``B`` dicts of extra values returned by the reward functions.
        failed: ``[B]`` bool.
        reasons: ``B`` entries, None or why the sample failed.
    """

    scores: Tensor
    extras: list[dict[str, Any]]
    failed: Tensor
    reasons: list[str | None]

    @classmethod
    def all_failed(cls, n: int, reason: str) -> RewardResult:
        """``n`` samples that all failed for one ``reason`` (e.g. the whole batch's scoring raised)."""
        return cls(
            scores=torch.full((n,), float("nan"), dtype=torch.float32),
            extras=[{} for _ in range(n)],
            failed=torch.ones(n, dtype=torch.bool),
            reasons=[reason] * n,
        )


@dataclass(frozen=True)
class RewardTerm:
    """One weighted reward function with verl-omni's 4-argument signature."""

    label: str
    fn: ScoreFn
    weight: float = 1.0


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if obj is None:
        return default
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _builtin_term(name: str, weight: float = 1.0, label: str | None = None) -> RewardTerm:
    image_fn = get_reward_function(name)

    def score(data_source: str, solution_image: Any, ground_truth: Any, extra_info: Any) -> float:
        return image_fn(solution_image)

    return RewardTerm(label=label or name, fn=score, weight=weight)


def _term_from_entry(entry: Any, position: int) -> RewardTerm:
    if isinstance(entry, str):
        return _builtin_term(entry)
    where = f"reward.reward_functions[{position}]"
    if isinstance(entry, Mapping):
        unknown = sorted(set(entry) - {"name", "path", "function", "weight"})
        if unknown:
            raise ValueError(f"{where} has unknown keys {unknown}; allowed: name, path, function, weight")
    weight = float(_get(entry, "weight", 1.0))
    path, name = _get(entry, "path"), _get(entry, "name")
    if path:
        function = _get(entry, "function") or DEFAULT_FUNCTION_NAME
        fn = load_reward_function(path, function)
        return RewardTerm(label=name or f"{Path(path).stem}.{function}", fn=fn, weight=weight)
    if not name:
        raise ValueError(f"{where} needs either 'name' (a built-in: {sorted(REWARD_FUNCTIONS)}) or 'path'")
    return _builtin_term(name, weight)


def _as_score(value: Any) -> tuple[float, dict[str, Any]]:
    """A reward's return value as ``(score, extras)``; raises on anything not a finite number."""
    extras: dict[str, Any] = {}
    if isinstance(value, Mapping):
        if "score" not in value:
            raise KeyError(f"returned a dict without 'score' (keys: {sorted(value)})")
        extras = {k: v for k, v in value.items() if k != "score"}
        value = value["score"]
    if isinstance(value, Tensor | np.ndarray) and np.size(value) == 1:
        value = value.item()  # a 0-d / 1-element tensor or array is a number
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"returned {type(value).__name__} {value!r:.80}, expected a number")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"returned non-finite score {score}")
    return score, extras


class RewardManager:
    """Scores images with the reward selection described in this module's docstring."""

    def __init__(self, reward_cfg: Any = None) -> None:
        """Build from the ``reward`` config section; loading errors (bad file, name) raise here."""
        aggregation = _get(reward_cfg, "aggregation", "weighted_sum")
        if aggregation != "weighted_sum":
            raise ValueError(f"reward.aggregation={aggregation!r} is not supported; use 'weighted_sum'")
        entries = _get(reward_cfg, "reward_functions") or []
        if isinstance(entries, Mapping):
            entries = reward_entries_from_verl_mapping(entries)
        if isinstance(entries, str):
            raise ValueError("reward.reward_functions must be a list of names or {name|path, weight} entries")
        custom = _get(reward_cfg, "custom_reward_function")
        path = _get(custom, "path")
        # An empty list means mode 3: dispatch on each sample's data_source.
        self.terms: list[RewardTerm] = []
        if entries:
            self.terms = [_term_from_entry(entry, i) for i, entry in enumerate(entries)]
        elif path:
            function = _get(custom, "name") or DEFAULT_FUNCTION_NAME
            fn = load_reward_function(path, function)
            self.terms = [RewardTerm(label=f"{Path(path).stem}.{function}", fn=fn)]
        # Per-term raw scores go into the extras only when they differ from the total.
        self._weighted = len(self.terms) > 1 or any(t.weight != 1.0 for t in self.terms)
        self._runner = DeadlineRunner(_get(reward_cfg, "timeout_s", None))

    def score(
        self,
        images: Tensor | Sequence[Any],
        data_sources: Sequence[str] | str,
        ground_truths: Sequence[Any] | None = None,
        extra_infos: Sequence[dict[str, Any] | None] | None = None,
    ) -> RewardResult:
        """Score ``B`` images (uint8 ``[B, 3, H, W]`` tensor, or a list of per-sample images)."""
        if isinstance(images, Tensor):
            images = list(images.detach().cpu().unbind(0))
        n = len(images)
        sources = [data_sources] * n if isinstance(data_sources, str) else list(data_sources)
        truths = list(ground_truths) if ground_truths is not None else [None] * n
        infos = [dict(x or {}) for x in extra_infos] if extra_infos is not None else [{} for _ in range(n)]
        if not len(sources) == len(truths) == len(infos) == n:
            raise ValueError(
                f"got {n} images, {len(sources)} data_sources, {len(truths)} ground_truths, "
                f"{len(infos)} extra_infos; they must match"
            )
        by_source: dict[str, list[RewardTerm]] = {}
        if not self.terms:
            unknown = sorted(set(sources) - set(REWARD_FUNCTIONS))
            if unknown:
                raise ValueError(
                    f"no built-in reward for data_source {unknown}; built-ins are "
                    f"{sorted(REWARD_FUNCTIONS)}. Set reward.custom_reward_function.path or "
                    "reward.reward_functions to score other data sources"
                )
            by_source = {src: [_builtin_term(src)] for src in set(sources)}

        scores = torch.full((n,), float("nan"), dtype=torch.float32)
        failed = torch.zeros(n, dtype=torch.bool)
        extras: list[dict[str, Any]] = [{} for _ in range(n)]
        reasons: list[str | None] = [None] * n
        hung: dict[str, str] = {}  # label -> why its remaining samples of this batch are not called
        for i in range(n):
            terms = self.terms or by_source[sources[i]]
            total = 0.0
            for term in terms:
                try:
                    if term.label in hung:
                        raise RewardTimeout(hung[term.label])
                    value = self._runner.call(term.fn, sources[i], images[i], truths[i], infos[i])
                    s, term_extras = _as_score(value)
                except Exception as err:  # a failing reward fails its sample, not the batch
                    if isinstance(err, RewardTimeout) and term.label not in hung:
                        hung[term.label] = f"not called: it {err} on sample {i} of this batch"
                    reasons[i] = f"{term.label}: {type(err).__name__}: {err}"
                    failed[i] = True
                    logger.warning("reward failed for sample %d: %s", i, reasons[i])
                    break
                total += term.weight * s
                if self._weighted:
                    extras[i][term.label] = s
                    extras[i].update({f"{term.label}/{k}": v for k, v in term_extras.items()})
                else:
                    extras[i].update(term_extras)
            if not failed[i]:
                scores[i] = total
        return RewardResult(scores=scores, extras=extras, failed=failed, reasons=reasons)
