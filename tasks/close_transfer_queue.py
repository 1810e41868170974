"""Stage 8 — close: verl-omni's `finally: tq.close()`, plus the run's actors and TQ rows (the trainer's
own `close()`) and, when this run started it, the local Ray cluster: a run leaves no processes
behind, also on failure."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from omni_core.distributed.ray_cluster import close_run
from omni_core.trainers.base import PolicyGradientDiffusionTrainerV1


@task(name="close_transfer_queue", cache_policy=NO_CACHE)
def close_transfer_queue(trainer: PolicyGradientDiffusionTrainerV1 | None, owns_ray: bool) -> None:
    """`trainer` is None when the run failed before `build_trainer`."""
    close_run(trainer, owns_ray)
