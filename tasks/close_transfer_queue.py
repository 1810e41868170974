"""Stage 8 — close: verl-omni's `finally: tq.close()`, plus the run's actors and (when this run
started it) the local Ray cluster, so a run leaves no processes behind, also on failure."""

from __future__ import annotations

import contextlib

import ray
from prefect import task
from prefect.cache_policies import NO_CACHE

from omni_core.tq.client import clear_partition
from omni_core.tq.client import close_transfer_queue as stop_transfer_queue
from omni_core.trainers.base import RunInfo


@task(name="close_transfer_queue", cache_policy=NO_CACHE)
def close_transfer_queue(owns_ray: bool, run: RunInfo) -> None:
    if ray.is_initialized():
        for partition in (run.train_partition, run.val_partition):
            with contextlib.suppress(Exception):
                clear_partition(partition)  # a shared controller keeps no rows of a finished run
        for name in ray.util.list_named_actors(all_namespaces=True):
            if name.get("namespace") == run.namespace and name["name"].startswith(f"omniflow-{run.run_id}-"):
                with contextlib.suppress(Exception):
                    ray.kill(ray.get_actor(name["name"], namespace=run.namespace), no_restart=True)
    stop_transfer_queue()
    if owns_ray:
        ray.shutdown()
