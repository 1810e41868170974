"""The resumable prompt loader: deterministic batches per epoch, and a JSON state to continue mid-epoch.

Plays the role of verl's `StatefulDataLoader` + seeded sampler. The order of epoch `e` is a function of
(seed, e) only, and the state is just (epoch, position), so a loader restored from a checkpoint yields
exactly the batches an uninterrupted one would (docs/design.md section 2: same seed, same result).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from omni_core.data.prompts import PromptRecord

STATE_VERSION = 1


def batches_per_epoch(n_records: int, batch_size: int, drop_last: bool = True) -> int:
    """Batches in one pass over `n_records` prompts: the last, partial one dropped unless `drop_last` is false."""
    return n_records // batch_size if drop_last else math.ceil(n_records / batch_size)


class PromptDataLoader:
    """Batches of `PromptRecord`s; `for batch in loader` runs the rest of the current epoch.

    The position advances when a batch is handed out; after the last batch of an epoch the loader is
    already at (epoch + 1, 0), so a checkpoint taken at an epoch boundary resumes at the next epoch.
    """

    def __init__(
        self, records: Sequence[PromptRecord], batch_size: int, *, shuffle: bool, seed: int | None, drop_last: bool = True
    ):
        if batch_size <= 0:
            raise ValueError(f"batch_size={batch_size} must be positive")
        if not records:
            raise ValueError("PromptDataLoader needs at least one prompt")
        if drop_last and len(records) < batch_size:
            raise ValueError(
                f"data.train_batch_size={batch_size} is larger than the {len(records)} prompts loaded, "
                f"so an epoch has no full batch; lower the batch size or add prompts"
            )
        self.records = list(records)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = 0 if seed is None else int(seed)  # data.seed=null still has to give a reproducible order
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # batches already handed out in `epoch`
        self._order_cache: tuple[int, list[int]] | None = None

    @property
    def steps_per_epoch(self) -> int:
        return batches_per_epoch(len(self.records), self.batch_size, self.drop_last)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[list[PromptRecord]]:
        start_epoch = self.epoch
        while self.epoch == start_epoch:
            yield self.next_batch()

    def next_batch(self) -> list[PromptRecord]:
        """The next batch, rolling over into the next epoch (with its own order) after the last one."""
        order = self._order(self.epoch)
        start = self.position * self.batch_size
        batch = [self.records[i] for i in order[start : start + self.batch_size]]
        self.position += 1
        if self.position >= self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        return batch

    def _order(self, epoch: int) -> list[int]:
        if self._order_cache is None or self._order_cache[0] != epoch:
            n = len(self.records)
            if self.shuffle:
                gen = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
                order = torch.randperm(n, generator=gen).tolist()
            else:
                order = list(range(n))
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    # ------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable: where to continue, plus what must match for the position to mean the same."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "batch_size": self.batch_size,
            "num_records": len(self.records),
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
            "fingerprint": self.fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; refuses one saved for other prompts or settings (the batches would differ)."""
        mismatched = [
            f"{key}: checkpoint {state.get(key)!r} vs now {value!r}"
            for key, value in self.state_dict().items()
            if key not in ("epoch", "position") and state.get(key) != value
        ]
        if mismatched:
            raise ValueError(
                "the checkpointed prompt-loader state does not match this loader ("
                + "; ".join(mismatched)
                + "); restore the same data settings, or start a new experiment (trainer.experiment_name=<new name>)"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.steps_per_epoch:
            raise ValueError(
                f"invalid prompt-loader state epoch={epoch} position={position} (steps_per_epoch={self.steps_per_epoch})"
            )
        self.epoch, self.position = epoch, position

    def fingerprint(self) -> str:
        """Short hash of the prompt texts in order, so a state is never applied to a different prompt set."""
        h = hashlib.sha256()
        for r in self.records:
            h.update(r.prompt.encode())
            h.update(b"\0" + (r.negative_prompt or "").encode() + b"\n")
        return h.hexdigest()[:16]


def _epoch_seed(seed: int, epoch: int) -> int:
    # A hash rather than seed + epoch: (seed=1, epoch=0) and (seed=0, epoch=1) must not share an order.
    digest = hashlib.sha256(f"omniflow-prompts:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
