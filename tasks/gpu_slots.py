"""GPU slots: the GPU-heavy tasks (`fit_epoch`, `evaluate_policy`) run inside `gpu_slot(...)`, which holds one slot of
a Prefect global concurrency limit (`trainer.concurrency.gpu_limit`, default `omniflow-gpu`), so that runs sharing
a Prefect server queue for the devices instead of oversubscribing them.

The limit is created on first use with `trainer.concurrency.gpu_limit_size` slots; an existing one keeps its size
(the UI's Concurrency page or `prefect gcl update` changes it). The slot is a lease of `SLOT_LEASE_S`, renewed while
the task runs: a holder killed without releasing it (a SIGKILLed Ray worker) frees it when the lease runs out. Runs
outside Prefect take no slot; the checkpoint folder's RunLock guards every run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from prefect import get_run_logger

from omni_core.config.schema import ConcurrencyConfig

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
def gpu_slot(cfg: ConcurrencyConfig, what: str) -> Iterator[None]:
    """Within: one slot of `cfg.gpu_limit` (nothing when it is null); the wait and the hold go to the run's log."""
    if cfg.gpu_limit is None:
        yield
        return
    from prefect.concurrency.sync import concurrency

    log = get_run_logger()
    size = ensure_gpu_limit(cfg.gpu_limit, cfg.gpu_limit_size)
    log.info(f"{what}: waiting for a slot of global concurrency limit {cfg.gpu_limit!r} ({size} slot(s))")
    asked = time.monotonic()
    with concurrency(cfg.gpu_limit, occupy=1, lease_duration=SLOT_LEASE_S, strict=True):
        log.info(f"{what}: took a slot of {cfg.gpu_limit!r} after {time.monotonic() - asked:.1f} s")
        yield
