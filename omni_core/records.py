"""Records that the flow, the tasks and the trainer hand each other: a run's identity and an epoch's result.

Light on purpose (no torch, no Ray, no Prefect): the flow process, a `fit_epoch` task on a Ray worker
and a parent pipeline all import these, and Prefect pickles them between tasks. TorchTune keeps such
records in `rlhf/_types.py`; this is OmniFlow's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# A log line that crosses a process boundary (worker -> controller -> Prefect run): (logging level, message).
LogLine = tuple[int, str]


def partition_id(run_id: str, split: Literal["train", "val"]) -> str:
    """The TQ partition of one run and split: ``"<run_id>/train"``. Runs sharing a cluster never collide."""
    if split not in ("train", "val"):
        raise ValueError(f"split={split!r} must be 'train' or 'val'")
    if not run_id:
        raise ValueError("run_id must be a non-empty string")
    return f"{run_id}/{split}"


@dataclass(frozen=True)
class WorkerNames:
    """Where a run's actors live: the Ray namespace and one name per role (also what the Ray dashboard shows)."""

    namespace: str
    run_id: str

    @property
    def training_actor(self) -> str:
        """Rank 0 of the training ranks (the only one with strategy=torch)."""
        return f"omniflow-{self.run_id}-training-actor"

    def training_rank(self, rank: int) -> str:
        return self.training_actor if rank == 0 else f"{self.training_actor}-rank{rank}"

    def rollout_worker(self, i: int) -> str:
        return f"omniflow-{self.run_id}-rollout-worker-{i}"

    @property
    def run_control(self) -> str:
        """The run's stop request (`omni_core.distributed.run_control`)."""
        return f"omniflow-{self.run_id}-run-control"


@dataclass(frozen=True)
class RunInfo:
    """Identity of one run: its id (TQ partitions, actor names), Ray namespace and output folders.

    `prompt_embeddings` is the safetensors file of the run's prompt embeddings (every train and
    validation prompt and negative prompt, encoded once by `prepare_prompt_embeddings`; read with
    `omni_core.models.prompt_embeddings.PromptEmbeddings`), or None when the workers encode prompts
    themselves.
    """

    run_id: str
    namespace: str
    checkpoint_dir: str
    log_dir: str
    prompt_embeddings: str | None = None
    # offline samples: the safetensors file of the preference pairs' image latents (`prepare_pair_latents`)
    pair_latents: str | None = None
    started_at: float | None = None  # wall clock (time.time()) when the run started: the console's elapsed time

    @property
    def names(self) -> WorkerNames:
        return WorkerNames(self.namespace, self.run_id)

    @property
    def train_partition(self) -> str:
        return partition_id(self.run_id, "train")

    @property
    def val_partition(self) -> str:
        return partition_id(self.run_id, "val")


@dataclass
class EpochResult:
    """What one `fit_epoch` returns to the flow (small and picklable).

    `step_metrics` holds one dict per trained step (verl-omni metric names); `val_grids` one
    `(step, PNG path, metrics)` per validation in the epoch, the PNG a grid with a row per prompt and a
    column per sample.
    """

    epoch: int
    global_step: int
    checkpoint: str | None
    step_metrics: list[dict[str, float]] = field(default_factory=list)
    val_metrics: dict[str, float] = field(default_factory=dict)
    val_grids: list[tuple[int, str, dict[str, float]]] = field(default_factory=list)


@dataclass(frozen=True)
class LocalUpdate:
    """Local update `index` of the `count` that one global step runs (separate_async: `parameter_sync_step`, each on
    `train_batch_size / count` prompts, as verl-omni's `step`; otherwise one). The shuffle is seeded by the update's
    own number; the learning-rate schedule counts updates."""

    index: int = 0
    count: int = 1

    def seed_step(self, global_step: int) -> int:
        """The update's number, counted from 1 over the run: the global step itself when a step is one update."""
        return (global_step - 1) * self.count + self.index + 1

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


ONE_UPDATE = LocalUpdate()
