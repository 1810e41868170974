"""GPU slots: a run holds slots of a Prefect global concurrency limit from its first model load until it closes
(`main_diffusion_v1`), one per GPU it uses, and the pipeline's `evaluate_policy` one while it runs, so that runs
aimed at the same GPUs queue instead of running out of memory.

Which limit and how many slots is `omni_core.resources.gpu_slot_request` (`trainer.concurrency`): by default
`omniflow-gpu-<host>` for a Ray cluster the run starts on its machine, `omniflow-gpu-<GCS address>` for a cluster it
joins, and no slot for a run on no GPU. The limit is created on first use (its size: `gpu_limit_size`, else the
cluster's GPUs); an existing one keeps its size (the UI's Concurrency page or `prefect gcl update` changes it), and
a run that needs more slots than it has is refused instead of waiting forever. The slots are a lease of
`SLOT_LEASE_S`, renewed while they are held: a holder killed without releasing them (a SIGKILLed flow process) frees
them when the lease runs out. Runs outside Prefect take no slot; the checkpoint folder's RunLock guards every run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from prefect import get_run_logger

from omni_core.config import OmniFlowConfig
from omni_core.distributed.ray_cluster import ray_cluster_label
from omni_core.resources import check_gpu_limit_size, gpu_slot_request

# The shortest lease Prefect's server grants (its minimum): how long a slot outlives a holder that was killed.
SLOT_LEASE_S = 60.0


def ensure_gpu_limit(name: str, size: int) -> int:
    """The size of global concurrency limit `name`, created with `size` slots if it does not exist yet."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            return client.read_global_concurrency_limit_by_name(name).limit
        except ObjectNotFound:
            pass
        with contextlib.suppress(ObjectAlreadyExists):  # another run created it first
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=size))
        return client.read_global_concurrency_limit_by_name(name).limit


@contextlib.contextmanager
def gpu_slots(config: OmniFlowConfig, what: str, gpus: int | None = None) -> Iterator[None]:
    """Within: the slots `gpu_slot_request` gives `config` (`gpus`: the devices this work uses, default the run's);
    nothing (and no log line) when it gives none. The wait and the hold go to the run's log."""
    request = gpu_slot_request(config, *ray_cluster_label(config), gpus=gpus)
    if request is None:
        yield
        return
    from prefect.concurrency.sync import concurrency

    log = get_run_logger()
    size = ensure_gpu_limit(request.limit, request.size)
    check_gpu_limit_size(request, size, what)
    log.info(f"{what}: waiting for {request.occupy} slot(s) of global concurrency limit {request.limit!r} ({size} slot(s))")
    asked = time.monotonic()
    with concurrency(request.limit, occupy=request.occupy, lease_duration=SLOT_LEASE_S, strict=True):
        log.info(f"{what}: took {request.occupy} slot(s) of {request.limit!r} after {time.monotonic() - asked:.1f} s")
        yield
