"""The run's training ranks: `trainer.n_gpus_per_node x trainer.nnodes` `TrainingActor`s, called as one.

verl-omni runs its actor as a worker group over a Ray resource pool; here each rank is a named Ray actor in
its bundle of the run's placement group (`resources.resource_plan`, `worker_pool`), rank 0 under the name a
one-rank run has. With more than one rank (`actor.strategy=ddp`), or with `fsdp2`, they form one
`torch.distributed` group (`form_group`: rank 0 offers the rendezvous address, every rank joins at once). A
rank that Ray restarted after its process died comes back without a group, so `restore` (at the start of
every epoch) forms the group again whenever the ranks do not all report the same one.

ddp / torch: rank 0 saves checkpoints and serves weights, a rank whose weights differ from the checkpoint
reloads on its own. fsdp2: those are collective, so every rank saves (its shards) and gathers the weights,
and any difference makes all ranks rebuild, shard and load the checkpoint together. `train_step` calls
every rank and merges their metrics over the ranks that report each (means of equal shares; maxima for timings,
worst-case figures and `*/max`; minima for `*/min`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ray

from omni_core.records import ONE_UPDATE, LocalUpdate, WorkerNames
from omni_core.resources import ResourcePlan

if TYPE_CHECKING:
    import torch

# Metrics whose merge over ranks is the maximum (the slowest rank, the worst sample), not the mean.
_MAX_METRICS = ("training/rollout_probs_diff_max", "actor/nonfinite_streak")


def merge_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from every rank's: the mean (each rank trained an equal share of the samples), the
    maximum for `timing_s/*`, the worst-case figures and keys ending in `/max`, the minimum for keys ending in `/min`.

    Ranks may report different keys (a rank that trained no sample of a staleness level has no ratio figures for
    it): each key merges over the ranks that report it. Such a mean weighs every rank alike, not by its samples.
    """
    merged: dict[str, float] = {}
    for key in dict.fromkeys(k for metrics in per_rank for k in metrics):  # the union, in first-seen order
        values = [metrics[key] for metrics in per_rank if key in metrics]
        if key.startswith("timing_s/") or key in _MAX_METRICS or key.endswith("/max"):
            merged[key] = max(values)
        elif key.endswith("/min"):
            merged[key] = min(values)
        else:
            merged[key] = sum(values) / len(values)
    return merged


class TrainingRanks:
    """Handles of the run's training actors, rank 0 first."""

    def __init__(self, handles: list[Any], strategy: str = "torch"):
        self.handles = handles
        self.strategy = strategy

    @property
    def collective(self) -> bool:
        """Saving, gathering weights and restoring need every rank (the parameters are shards)."""
        return self.strategy == "fsdp2"

    @property
    def leader(self) -> Any:
        """Rank 0: checkpoints, weights for the rollout side, the version every rank shares."""
        return self.handles[0]

    @property
    def world_size(self) -> int:
        return len(self.handles)

    @classmethod
    def create(
        cls,
        config: Any,
        names: WorkerNames,
        plan: ResourcePlan,
        options: list[dict[str, Any]],
        total_steps: int,
        threads: int,
        colocated_rollout: dict[str, Any] | None = None,
    ) -> TrainingRanks:
        """Start one actor per rank (or find the ones of this run that exist: a retried init keeps them).
        `colocated_rollout` (the hybrid engine): `TrainingActor`'s `rollout_threads` and `prompt_embeddings`."""
        from omni_core.workers.training_actor import TrainingActor  # diffusers: only where the actors start

        remote = ray.remote(TrainingActor)
        world = len(plan.training)
        handles = [
            remote.options(
                name=names.training_rank(rank), namespace=names.namespace, max_restarts=3, get_if_exists=True, **options[rank]
            ).remote(
                config.model_dump(mode="json"), total_steps, threads, rank=rank, world_size=world, **(colocated_rollout or {})
            )
            for rank in range(world)
        ]
        return cls(handles, config.actor_rollout_ref.actor.strategy)

    @classmethod
    def attach(cls, names: WorkerNames, world_size: int, strategy: str) -> TrainingRanks:
        """The run's ranks by name (from a `fit_epoch` task on another Ray worker)."""
        handles = [ray.get_actor(names.training_rank(r), namespace=names.namespace) for r in range(world_size)]
        return cls(handles, strategy)

    def _generations(self, timeout_s: float) -> list[int | None]:
        return ray.get([h.get_group_generation.remote() for h in self.handles], timeout=timeout_s)

    def form_group(self, timeout_s: float, checkpoint: str | None = None, force: bool = False) -> bool:
        """Make every rank a member of one live group; True when a new one was formed. Nothing to do for one
        ddp / torch rank, or when all ranks report the same generation (none was restarted since it formed)
        and `force` is off. fsdp2 ranks rebuild and load `checkpoint` (None: the base model) as they join."""
        if self.world_size == 1 and not self.collective:
            return False
        generations = self._generations(timeout_s)
        if not force and generations[0] is not None and len(set(generations)) == 1:
            return False
        generation = max((g for g in generations if g is not None), default=0) + 1
        address, port = ray.get(self.leader.rendezvous_address.remote(), timeout=timeout_s)
        calls = [h.join_process_group.remote(address, port, generation, checkpoint) for h in self.handles]
        ray.get(calls, timeout=timeout_s)
        return True

    def restore(self, checkpoint: str | None, step: int, timeout_s: float) -> list[str]:
        """Every rank at `checkpoint` (None: the base model, step 0) and in one group; returns what changed, as
        log lines. Called at the start of every epoch, after the ranks Ray was restarting are back."""
        versions = self.versions(timeout_s)
        stale = [r for r, v in enumerate(versions) if v != step or checkpoint is None and v != 0]
        where = f"step {step}" if checkpoint else "the base model"
        if self.collective:
            generations = self._generations(timeout_s)
            if stale or None in generations or len(set(generations)) > 1:
                self.form_group(timeout_s, checkpoint, force=True)
                if any(g is not None for g in generations):  # not the first forming: a rank was restarted or moved on
                    return [f"the {self.world_size} fsdp2 training ranks loaded {where} and formed their group again"]
            return []
        ray.get([self.handles[r].reset.remote(checkpoint) for r in stale], timeout=timeout_s)
        who = ["training actor" if self.world_size == 1 else f"training rank {r}" for r in stale]
        lines = [f"{w} reset to {where} (its weights were at step {versions[r]})" for w, r in zip(who, stale, strict=True)]
        if self.form_group(timeout_s) and stale:
            lines.append(f"the {self.world_size} training ranks formed their process group again")
        return lines

    def save(self, tmp_dir: str, timeout_s: float) -> None:
        """The actor part of a checkpoint: rank 0 writes it (fsdp2: every rank writes its shards too)."""
        handles = self.handles if self.collective else [self.leader]
        ray.get([h.save.remote(tmp_dir) for h in handles], timeout=timeout_s)

    def weights_ref(self, timeout_s: float) -> Any:
        """An ObjectRef of the weights the rollout side loads (rank 0's; fsdp2: gathered from every rank)."""
        if not self.collective:
            return self.leader.get_weights.remote()
        refs = [h.get_weights.remote() for h in self.handles]
        ray.get(refs[1:], timeout=timeout_s)  # the other ranks only take part in the gather
        return refs[0]

    def ema_weights_ref(self) -> Any:
        """An ObjectRef of the moving average of the weights (`actor.ema`; never sharded: fsdp2 is refused with it)."""
        return self.leader.get_ema_weights.remote()

    def train_step(
        self,
        partition: str,
        keys: list[str],
        advantages: Any,
        step: int,
        timeout_s: float,
        staleness: torch.Tensor | None = None,
        local: LocalUpdate = ONE_UPDATE,
    ) -> dict[str, float]:
        """One training step (or one of its local updates, `local`) on every rank (each reads its own samples); the
        merged metrics. `staleness`: None (on-policy) or each key's staleness in model versions, a float tensor `[B]`
        in the order of `keys`."""
        calls = [h.train_step.remote(partition, keys, advantages, step, staleness=staleness, local=local) for h in self.handles]
        return merge_rank_metrics(ray.get(calls, timeout=timeout_s))

    def versions(self, timeout_s: float) -> list[int]:
        return ray.get([h.get_version.remote() for h in self.handles], timeout=timeout_s)

    def kill(self) -> None:
        for handle in self.handles:
            ray.kill(handle, no_restart=True)  # also fine for an actor that already died
