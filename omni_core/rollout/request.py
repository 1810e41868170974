"""A rollout request: what the controller sends a rollout worker (the data comes back through the TQ).

An item is a prompt uid plus its ``PromptRecord`` and its position in the request (which, with the
global step, seeds its samples, so they do not depend on how the request was split across workers).
Plain Python: the controller, the agent loop and the workers import it.
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_core.data.prompts import PromptRecord
from omni_core.rollout.sampling_params import SamplingParams


@dataclass(frozen=True)
class RolloutItem:
    """One prompt of a request: its deterministic uid, its position in the request and the record itself."""

    uid: str
    position: int
    record: PromptRecord


@dataclass(frozen=True)
class RolloutRequest:
    """Prompts to sample into TQ partition ``partition`` for ``global_step``, all with ``params``."""

    partition: str
    global_step: int
    params: SamplingParams
    items: tuple[RolloutItem, ...]

    @classmethod
    def of_records(
        cls, partition: str, global_step: int, params: SamplingParams, records: list[PromptRecord], uid_prefix: str
    ) -> RolloutRequest:
        """Deterministic uids ``<uid_prefix>-<position>``: sortable, reproducible, never uuid4."""
        items = tuple(RolloutItem(f"{uid_prefix}-{i:04d}", i, r) for i, r in enumerate(records))
        return cls(partition, global_step, params, items)

    @property
    def uids(self) -> list[str]:
        return [it.uid for it in self.items]

    @property
    def num_samples(self) -> int:
        return len(self.items) * self.params.n

    def split(self, k: int) -> list[RolloutRequest]:
        """``k`` contiguous parts (some may be empty), one per worker."""
        n = len(self.items)
        return [
            RolloutRequest(self.partition, self.global_step, self.params, self.items[i * n // k : (i + 1) * n // k])
            for i in range(k)
        ]
