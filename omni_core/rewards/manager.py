"""Score a batch of generated images: which reward functions run, and how failures are reported.

Built from the ``reward`` config section (duck-typed attributes or a mapping), which selects one of
three modes, first match wins:

1. ``reward.reward_functions`` non-empty -> **weighted sum**. Each entry is a built-in name
   (``"jpeg_compressibility"``, weight 1.0) or a mapping ``{name: <built-in>, weight: w}`` or
   ``{path: <file.py>, function: <fn, default compute_score>, name: <label>, weight: w}``, or a batched
   term: a model reward ``{name: pickscore | clip_score | aesthetic, model_path, ...}`` (``model_rewards``)
   or a reward server ``{server_url, ...}`` (``server_client``); the keys each kind takes: ``entries``.
   The score is ``sum_k w_k * s_k``; each term's raw score is kept in the extras under its label
   (and a term's own extras as ``<label>/<key>``). ``reward.aggregation`` must be ``weighted_sum``.
   verl-omni's mapping form ``{label: {path, name: <function>, weight}}`` is accepted too.
2. ``reward.custom_reward_function.path`` set -> that file's ``custom_reward_function.name``
   (default ``compute_score``), verl-omni's contract
   ``compute_score(data_source, solution_image, ground_truth, extra_info) -> float | {"score": ...}``.
3. Otherwise -> each sample's ``data_source`` names the reward to use, a built-in or one a recipe added
   (``plugins``; verl-omni's ``default_compute_score``); a data source without a reward is an error,
   raised before any scoring.

A reward that raises, returns NaN / inf, or returns something that is not a number marks only that
sample as failed (score NaN, ``failed`` True, reason ``"<label>: <ExcType>: <message>"``); it never
becomes a silent 0 and never stops the rest of the batch. A batched term that fails a sample with a
reason (a reward server's per-image error) fails only that sample, ``"<label>: <reason>"``; a batch call
that raises fails the samples of that batch. A call that takes longer than ``reward.timeout_s`` (one
sample of a per-sample term, one batch of a batched term) fails its samples with ``"timed out after N s"``
(see ``deadline`` for what happens to the hung call) and the term's remaining samples of that score call
fail without a call, so a hung reward costs one timeout per batch. Terms run in order; a sample that
failed one term is not handed to the next. The trainer decides what failed samples mean (``failures``:
advantage 0 below ``reward.max_failure_ratio``, a ``RewardFailureError`` above it).
"""

from __future__ import annotations

import importlib
import logging
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError
from torch import Tensor

from omni_core.config.schema import RewardFunctionSpec, reward_entries_from_verl_mapping
from omni_core.config.unsupported import REWARD_MODEL_REASON
from omni_core.rewards.custom import DEFAULT_FUNCTION_NAME, load_reward_function
from omni_core.rewards.deadline import DeadlineRunner, RewardTimeout
from omni_core.rewards.entries import entry_kind, given_entry_keys, refused_entry_keys
from omni_core.rewards.failures import RewardFailureError
from omni_core.rewards.names import DATA_SOURCE_REWARDS, MODEL_REWARD_NAMES, PACKAGED_REWARDS
from omni_core.rewards.plugins import find_reward
from omni_core.rewards.registry import REWARD_FUNCTIONS, get_reward_function, reward_choices
from omni_core.rewards.terms import BatchRewardTerm, RewardBatch, RewardTerm, SampleFailure

__all__ = ["BatchRewardTerm", "RewardFailureError", "RewardManager", "RewardResult", "RewardTerm"]

logger = logging.getLogger(__name__)

Term = RewardTerm | BatchRewardTerm


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


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if obj is None:
        return default
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _packaged_term(name: str, spec: Any) -> Term:
    """The term of a reward whose model ships in an installed package (`names.PACKAGED_REWARDS`)."""
    return importlib.import_module(PACKAGED_REWARDS[name]).term(spec)


def _source_term(data_source: str) -> Term:
    """The reward a sample's data_source names (mode 3): a built-in, a packaged model reward (directly or under
    verl-omni's data_source name, `names.DATA_SOURCE_REWARDS`) or one a recipe added."""
    name = DATA_SOURCE_REWARDS.get(data_source, data_source)
    if name in PACKAGED_REWARDS:
        return _packaged_term(name, RewardFunctionSpec(name=name))
    return _builtin_term(data_source)


def _builtin_term(name: str, weight: float = 1.0, label: str | None = None) -> RewardTerm:
    builtin = get_reward_function(name)

    def score(data_source: str, solution_image: Any, ground_truth: Any, extra_info: Any) -> Any:
        return builtin(solution_image, ground_truth)

    return RewardTerm(label=label or name, fn=score, weight=weight)


def _term_from_entry(entry: Any, position: int, device: str | None) -> Term:
    where = f"reward.reward_functions[{position}]"
    given = given_entry_keys(entry)
    refused = refused_entry_keys(given)
    if refused:
        details = "; ".join(f"{k}: {why}" for k, why in sorted(refused.items()))
        raise ValueError(f"{where} has unknown keys {sorted(refused)} ({details})")
    try:
        spec = RewardFunctionSpec.model_validate(given)
    except ValidationError as err:
        raise ValueError(f"{where} is not a valid reward entry: {err}") from err
    kind = entry_kind(given)
    if kind in ("server", "verl_http"):
        from omni_core.rewards.server_client import server_term  # httpx only where a server is used

        return server_term(spec, verl_client=kind == "verl_http")
    if kind == "model":
        from omni_core.rewards.model_rewards import model_term  # transformers only where a model is used

        return model_term(spec, device=device, where=where)
    if kind == "packaged":
        return _packaged_term(str(spec.name), spec)
    if kind == "file":
        fn = load_reward_function(spec.path, spec.function)
        return RewardTerm(label=spec.name or f"{Path(spec.path).stem}.{spec.function}", fn=fn, weight=spec.weight)
    if not spec.name:
        raise ValueError(
            f"{where} needs 'name' ({reward_choices()}; a model reward: {list(MODEL_REWARD_NAMES)} "
            "with model_path), 'path' (a reward file) or 'server_url' (a reward server)"
        )
    return _builtin_term(spec.name, spec.weight)


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

    def __init__(self, reward_cfg: Any = None, device: str | None = None) -> None:
        """Build from the ``reward`` config section; loading errors (bad file, name, model folder) raise here.

        ``device``: where model rewards run (``trainer.device``: auto, cuda, npu or cpu; None means auto).
        """
        aggregation = _get(reward_cfg, "aggregation", "weighted_sum")
        if aggregation != "weighted_sum":
            raise ValueError(f"reward.aggregation={aggregation!r} is not supported; use 'weighted_sum'")
        if _get(_get(reward_cfg, "reward_model"), "enable", False):
            raise ValueError(f"reward.reward_model.enable=true is not supported: {REWARD_MODEL_REASON}")
        entries = _get(reward_cfg, "reward_functions") or []
        if isinstance(entries, Mapping):
            entries = reward_entries_from_verl_mapping(entries)
        if isinstance(entries, str):
            raise ValueError("reward.reward_functions must be a list of names or {name|path, weight} entries")
        custom = _get(reward_cfg, "custom_reward_function")
        path = _get(custom, "path")
        # An empty list means mode 3: dispatch on each sample's data_source.
        self.terms: list[Term] = []
        if entries:
            self.terms = [_term_from_entry(entry, i, device) for i, entry in enumerate(entries)]
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
        prompts: Sequence[str | None] | None = None,
    ) -> RewardResult:
        """Score ``B`` images (uint8 ``[B, 3, H, W]`` tensor, or a list of per-sample images).

        ``prompts``: the text each image was generated from (model rewards that compare image and text, and reward
        servers, need it; None gives each sample ``None``).
        """
        if isinstance(images, Tensor):
            images = list(images.detach().cpu().unbind(0))
        n = len(images)
        sources = [data_sources] * n if isinstance(data_sources, str) else list(data_sources)
        truths = list(ground_truths) if ground_truths is not None else [None] * n
        infos = [dict(x or {}) for x in extra_infos] if extra_infos is not None else [{} for _ in range(n)]
        texts = list(prompts) if prompts is not None else [None] * n
        if not len(sources) == len(truths) == len(infos) == len(texts) == n:
            raise ValueError(
                f"got {n} images, {len(sources)} data_sources, {len(truths)} ground_truths, "
                f"{len(infos)} extra_infos, {len(texts)} prompts; they must match"
            )
        per_sample: list[list[Term]] = [self.terms] * n
        if not self.terms:
            unknown = sorted(
                src
                for src in set(sources)
                if src not in REWARD_FUNCTIONS
                and DATA_SOURCE_REWARDS.get(src, src) not in PACKAGED_REWARDS
                and find_reward(src) is None
            )
            if unknown:
                raise ValueError(
                    f"no built-in reward for data_source {unknown}; {reward_choices()}. Set reward.custom_reward_function.path "
                    "or reward.reward_functions to score other data sources"
                )
            by_source = {src: _source_term(src) for src in dict.fromkeys(sources)}
            per_sample = [[by_source[src]] for src in sources]

        batch = RewardBatch(images=images, prompts=texts, data_sources=sources, ground_truths=truths, extra_infos=infos)
        totals = [0.0] * n
        failed = torch.zeros(n, dtype=torch.bool)
        extras: list[dict[str, Any]] = [{} for _ in range(n)]
        reasons: list[str | None] = [None] * n
        # Term by term (in order; a sample that failed a term is not handed to the next one).
        for term in list({id(t): t for terms in per_sample for t in terms}.values()):
            indices = [i for i in range(n) if not failed[i] and any(t is term for t in per_sample[i])]
            if isinstance(term, BatchRewardTerm):
                outcomes = self._run_batched(term, indices, batch)
            else:
                outcomes = self._run_per_sample(term, indices, batch)
            for i, outcome in outcomes.items():
                if isinstance(outcome, str):  # why the sample failed
                    reasons[i] = outcome
                    failed[i] = True
                    logger.warning("reward failed for sample %d: %s", i, outcome)
                    continue
                s, term_extras = outcome
                totals[i] += term.weight * s
                if self._weighted:
                    extras[i][term.label] = s
                    extras[i].update({f"{term.label}/{k}": v for k, v in term_extras.items()})
                else:
                    extras[i].update(term_extras)
        scores = torch.tensor(totals, dtype=torch.float32)
        scores[failed] = float("nan")
        return RewardResult(scores=scores, extras=extras, failed=failed, reasons=reasons)

    def _run_per_sample(self, term: RewardTerm, indices: list[int], batch: RewardBatch) -> dict[int, Any]:
        """Sample by sample: ``{i: (score, extras) | reason}``; after a timeout the term's later samples are not called."""
        outcomes: dict[int, Any] = {}
        hung: str | None = None
        for i in indices:
            try:
                if hung is not None:
                    raise RewardTimeout(hung)
                value = self._runner.call(
                    term.fn, batch.data_sources[i], batch.images[i], batch.ground_truths[i], batch.extra_infos[i]
                )
                outcomes[i] = _as_score(value)
            except Exception as err:  # a failing reward fails its sample, not the batch
                if isinstance(err, RewardTimeout) and hung is None:
                    hung = f"not called: it {err} on sample {i} of this batch"
                outcomes[i] = f"{term.label}: {type(err).__name__}: {err}"
        return outcomes

    def _run_batched(self, term: BatchRewardTerm, indices: list[int], batch: RewardBatch) -> dict[int, Any]:
        """Batches of ``term.batch_size``, ``term.max_concurrency`` at once: ``{i: (score, extras) | reason}``."""
        chunks = [indices[k : k + term.batch_size] for k in range(0, len(indices), term.batch_size)]
        jobs = [
            RewardBatch(
                images=[batch.images[i] for i in chunk],
                prompts=[batch.prompts[i] for i in chunk],
                data_sources=[batch.data_sources[i] for i in chunk],
                ground_truths=[batch.ground_truths[i] for i in chunk],
                extra_infos=[batch.extra_infos[i] for i in chunk],
            )
            for chunk in chunks
        ]
        outcomes: dict[int, Any] = {}
        for chunk, result in zip(chunks, self._runner.call_batches(term.fn, jobs, term.max_concurrency), strict=True):
            if isinstance(result, BaseException):  # the whole batch call failed: each of its samples, with the reason
                outcomes.update({i: f"{term.label}: {type(result).__name__}: {result}" for i in chunk})
                continue
            if not isinstance(result, Sequence) or len(result) != len(chunk):
                got = len(result) if isinstance(result, Sequence) else type(result).__name__
                outcomes.update({i: f"{term.label}: returned {got} outcomes for a batch of {len(chunk)}" for i in chunk})
                continue
            for i, value in zip(chunk, result, strict=True):
                if isinstance(value, SampleFailure):
                    outcomes[i] = f"{term.label}: {value}"
                    continue
                try:
                    outcomes[i] = _as_score(value)
                except Exception as err:
                    outcomes[i] = f"{term.label}: {type(err).__name__}: {err}"
        return outcomes
