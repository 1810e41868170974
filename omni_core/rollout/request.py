"""A rollout request: what the controller sends a rollout worker (the data comes back through the TQ).

An item is a prompt uid plus its ``PromptRecord`` and its position in the request (which, with the
global step, seeds its samples, so they do not depend on how the request was split across workers).
Plain Python: the controller, the agent loop and the workers import it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

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
    """Prompts to sample into TQ partition ``partition`` for ``global_step``, all with ``params``.

    separate_async: ``weights`` (a Ray ObjectRef of the transformer's trainable state) and ``weights_version``
    are the weights the worker must sample with; it loads them before the request when its own differ, so a
    worker switches version between requests, never inside one. None: the worker's current weights (sync).
    ``weights_ema``: those weights are the moving average of version ``weights_version`` (``actor.ema``, for
    validation); a training rank that samples itself (the hybrid engine) loads its own average, with no ``weights``.
    """

    partition: str
    global_step: int
    params: SamplingParams
    items: tuple[RolloutItem, ...]
    weights_version: int | None = None
    weights: Any = None
    weights_ema: bool = False

    @classmethod
    def of_records(
        cls,
        partition: str,
        global_step: int,
        params: SamplingParams,
        records: list[PromptRecord],
        uid_prefix: str,
        first_position: int = 0,
    ) -> RolloutRequest:
        """Deterministic uids ``<uid_prefix>-<i>``: sortable, reproducible, never uuid4. The prompts take positions
        ``first_position + i``: another batch of the same step (a refill) starts past the step's positions, so that
        its samples get seeds of their own."""
        items = tuple(RolloutItem(f"{uid_prefix}-{i:04d}", first_position + i, r) for i, r in enumerate(records))
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
        return [replace(self, items=self.items[i * n // k : (i + 1) * n // k]) for i in range(k)]

    def chunks(self, size: int) -> list[RolloutRequest]:
        """Contiguous parts of at most ``size`` prompts (``data.gen_batch_size`` / ``data.val_batch_size``)."""
        if size < 1:
            raise ValueError(f"chunk size {size} must be >= 1")
        return [replace(self, items=self.items[i : i + size]) for i in range(0, len(self.items), size)]

    def assign(self, workers: int, chunk_size: int | None = None) -> list[list[RolloutRequest]]:
        """The calls each of ``workers`` workers makes: without ``chunk_size``, one contiguous part each;
        with it, chunks of ``chunk_size`` prompts dealt round-robin (a worker runs its chunks in order)."""
        if chunk_size is None:
            return [[part] if part.items else [] for part in self.split(workers)]
        calls: list[list[RolloutRequest]] = [[] for _ in range(workers)]
        for i, chunk in enumerate(self.chunks(chunk_size)):
            calls[i % workers].append(chunk)
        return calls
