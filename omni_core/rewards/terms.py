"""The two kinds of reward term the manager combines, and what a batched term is handed.

A `RewardTerm` is called once per sample with verl-omni's 4-argument signature (built-ins, reward files). A
`BatchRewardTerm` is called once per batch of at most `batch_size` samples (model rewards, reward servers) and
returns one outcome per sample: a number, a `{"score": ..., <extras>}` dict, or a `SampleFailure` that fails only
that sample with its reason (e.g. the reason a reward server gave). `max_concurrency` batches of one call may run
at once (a server term; a model term on one device runs its batches one after another).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["BatchRewardTerm", "RewardBatch", "RewardTerm", "SampleFailure"]

ScoreFn = Callable[[str, Any, Any, dict[str, Any]], Any]


@dataclass(frozen=True)
class RewardTerm:
    """One weighted reward function with verl-omni's 4-argument signature."""

    label: str
    fn: ScoreFn
    weight: float = 1.0


@dataclass(frozen=True)
class RewardBatch:
    """The samples of one batch call: images (uint8 CHW tensors from a rollout; HWC arrays or PIL images in library
    use, see `builtin.to_hwc_uint8`) and, per image, its prompt (None when the caller has none) and dataset fields."""

    images: Sequence[Any]
    prompts: Sequence[str | None]
    data_sources: Sequence[str]
    ground_truths: Sequence[Any]
    extra_infos: Sequence[dict[str, Any]]

    def __len__(self) -> int:
        return len(self.images)


class SampleFailure(Exception):
    """Returned (not raised) by a batched term for a sample it could not score; the message is the reason."""


@dataclass(frozen=True)
class BatchRewardTerm:
    """A weighted reward scored a batch at a time: `fn(batch) -> [score | {"score", ...} | SampleFailure] * len(batch)`."""

    label: str
    fn: Callable[[RewardBatch], Sequence[Any]]
    weight: float = 1.0
    batch_size: int = 16
    max_concurrency: int = 1
