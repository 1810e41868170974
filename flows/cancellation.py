"""Stopping a run promptly when it is cancelled (Prefect UI / API, `prefect flow-run cancel`) or crashes.

A served or deployed run is cancelled by a SIGTERM from its runner, which Prefect's engine turns into a
`TerminationSignal` in the flow's main thread; the flow's `finally` then closes the TransferQueue, the run's
actors and the Ray cluster it started. Two things keep that within seconds:

- `wait_for_epoch`: the flow waits for a `fit_epoch` in short slices, never in one long `ray.get` (a signal
  handler runs only when that call returns: measured, a run cancelled mid-epoch went on to the epoch's end
  and its processes took 31 s to go). When the wait is interrupted, the epoch's Ray task is cancelled first
  (`stop_epoch`), so its `fit_epoch` gives its GPU slot back and stops writing; the last checkpoint is the last
  complete one (checkpoints are written to a temporary folder and renamed).
- `close_after_cancel_or_crash`: the flow's `on_cancellation` / `on_crashed` hook, a backstop that runs even
  when no new task may start: in a process connected to Ray, it kills the run's named actors (by the run id
  in their names), closes the TransferQueue this process started and stops the Ray cluster it started. In a
  runner process (`omniflow serve`, a worker), which runs the cancellation hook after the flow process ended,
  there is nothing of the run left to stop.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

# A wait on a fit_epoch returns at least this often, so that a cancellation's signal is handled at once.
WAIT_SLICE_S = 0.5
# How long a cancelled fit_epoch may take to unwind (release its GPU slot) before its worker is killed.
STOP_EPOCH_WAIT_S = 5.0

log = logging.getLogger("omniflow.cancellation")


def wait_for_epoch(future: Any, timeout_s: float) -> Any:
    """`future.result(timeout_s)` of a `fit_epoch` on Ray, waiting in `WAIT_SLICE_S` slices; interrupted (a
    cancellation, Ctrl-C), it stops the epoch's task before re-raising."""
    import ray

    ref = future.wrapped_future
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _ = ray.wait([ref], timeout=WAIT_SLICE_S)
            if ready:
                break
    except BaseException as exc:
        stop_epoch(ref)
        # A signal handled inside Ray's C call surfaces as a SystemError caused by the signal's own exception (Prefect's
        # TerminationSignal, KeyboardInterrupt): raise that, so the engine sees a cancellation, not a failure.
        cause = exc.__cause__
        if isinstance(exc, SystemError) and isinstance(cause, BaseException) and not isinstance(cause, Exception):
            raise cause from None
        raise
    return future.result(timeout=max(0.0, deadline - time.monotonic()))


def stop_epoch(ref: Any) -> None:
    """Cancel a running `fit_epoch` task: a KeyboardInterrupt in its worker (its GPU slot is given back as it
    unwinds), then, if it is still running after `STOP_EPOCH_WAIT_S`, its worker is killed."""
    import ray

    with contextlib.suppress(Exception):
        ray.cancel(ref, force=False)
        ready, _ = ray.wait([ref], timeout=STOP_EPOCH_WAIT_S)
        if not ready:
            ray.cancel(ref, force=True)


def run_actor_names(flow_run_id: Any, namespace: str) -> list[str]:
    """Named actors of the run of `flow_run_id` in `namespace` (their names carry `<experiment>-<first 8 of the
    flow run id>`: `omni_core.records.WorkerNames`)."""
    import ray

    marker = f"-{str(flow_run_id)[:8]}-"
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == namespace and a["name"].startswith("omniflow-") and marker in a["name"]
    ]


def close_after_cancel_or_crash(flow: Any, flow_run: Any, state: Any) -> None:
    """`on_cancellation` / `on_crashed` hook of `main_diffusion_v1`: what the run left in this process's Ray."""
    import sys

    if "ray" not in sys.modules:
        return  # a runner process: the flow ran (and ended) in its own process
    import ray

    from omni_core import ray_cluster

    if not ray.is_initialized():
        return
    killed = []
    with contextlib.suppress(Exception):
        for name in run_actor_names(flow_run.id, ray_cluster.NAMESPACE):
            with contextlib.suppress(ValueError):
                ray.kill(ray.get_actor(name, namespace=ray_cluster.NAMESPACE), no_restart=True)
                killed.append(name)
    # The TransferQueue when this process started it (else it only detaches), and the Ray cluster when this process
    # started it (`_started_ray`: also when the flow never learnt owns_ray).
    with contextlib.suppress(Exception):
        ray_cluster.close_run(None, owns_ray=False)
    log.info(
        "%s (%s): killed %s; Ray %s",
        flow_run.name,
        state.name,
        killed or "no leftover actor",
        ray.is_initialized() and "still connected" or "stopped",
    )
