"""Stopping a run promptly when it is cancelled (Prefect UI / API, `prefect flow-run cancel`), stopped (Ctrl-C,
SIGTERM) or crashes.

A served or deployed run is cancelled by a SIGTERM from its runner, which Prefect's engine turns into a
`TerminationSignal` in the flow's main thread; Ctrl-C is a `KeyboardInterrupt` there, and `omniflow train` turns
SIGTERM into one too (`runner.py`). The flow's `finally` then closes the TransferQueue, the run's actors and the
Ray cluster it started. What keeps that prompt and clean:

- `wait_for_epoch`: the flow waits for a `fit_epoch` in short slices, never in one long `ray.get` (a signal
  handler runs only when that call returns: measured, a run cancelled mid-epoch went on to the epoch's end
  and its processes took 31 s to go). When the wait is interrupted, the epoch is stopped first (`stop_epoch`),
  so its `fit_epoch` gives its GPU slot back and stops writing; the last checkpoint is the last complete one
  (checkpoints are written to a temporary folder and renamed). With `trainer.epoch_timeout_s`, the same wait stops
  the epoch once its deadline has passed (`EpochDeadlinePassed`; the flow fails with `EpochTimeoutError`).
- `stop_epoch` asks, never cancels: `ray.cancel` of a task whose reply is being handled aborts the whole
  process in Ray 2.60 (`omni_core.distributed.run_control` says why), and a stop is handled exactly when an epoch ends more
  often than not. The epoch sees the request before its next step; a step blocked in an actor call ends when the
  run's actors are killed after `STOP_REQUEST_GRACE_S`.
- `stop_signals_held`: the few statements between two waits that hand Prefect a task's inputs to serialise run
  with SIGTERM and SIGINT held, so a signal is raised after them, not inside pydantic's serializer (measured: it
  became a `PydanticSerializationError`, and the run ended Failed with a traceback instead of stopped).
- `close_after_cancel_or_crash`: the flow's `on_cancellation` / `on_crashed` hook, a backstop that runs even
  when no new task may start: in a process connected to Ray, it kills the run's named actors (by the run id
  in their names), closes the TransferQueue this process started and stops the Ray cluster it started. In a
  runner process (`omniflow serve`, a worker), which runs the cancellation hook after the flow process ended,
  there is nothing of the run left to stop.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

from omni_core.records import WorkerNames

# A wait on a fit_epoch returns at least this often, so that a cancellation's signal is handled at once.
WAIT_SLICE_S = 0.5
# How long a stopped fit_epoch may take to reach its next step before the run's actors are killed (so that a step
# blocked in an actor call ends: the flow's close would kill them anyway), and after that to unwind (give its GPU
# slot back). A cancelled run's processes are gone within seconds (tests/test_concurrency_and_cancellation.py).
STOP_REQUEST_GRACE_S = 2.0
STOP_UNWIND_WAIT_S = 5.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

log = logging.getLogger("omniflow.cancellation")


class EpochDeadlinePassed(Exception):
    """`wait_for_epoch`'s deadline passed; the epoch has been stopped."""


def wait_for_epoch(future: Any, names: WorkerNames, deadline: float | None = None) -> Any:
    """`future.result()` of a `fit_epoch` on Ray, waiting in `WAIT_SLICE_S` slices until it is done or, with a
    `deadline` (`time.monotonic()` seconds), until then: `EpochDeadlinePassed` once the epoch has been stopped
    (`stop_epoch`). Interrupted (a cancellation, Ctrl-C, SIGTERM), it stops the run's epoch before re-raising."""
    import ray

    ref = future.wrapped_future
    try:
        while True:
            ready, _ = ray.wait([ref], timeout=WAIT_SLICE_S)
            if ready:
                break
            if deadline is not None and time.monotonic() >= deadline:
                with stop_signals_held():
                    stop_epoch(ref, names, "the epoch's time bound (trainer.epoch_timeout_s) passed")
                raise EpochDeadlinePassed()
    except EpochDeadlinePassed:
        raise
    except BaseException as exc:
        # A signal handled inside Ray's C call surfaces as a SystemError caused by the signal's own exception (Prefect's
        # TerminationSignal, KeyboardInterrupt): that is the stop, and it is what is raised, so the engine sees a
        # cancellation, not a failure.
        cause = exc.__cause__
        stop = (
            cause
            if isinstance(exc, SystemError) and isinstance(cause, BaseException) and not isinstance(cause, Exception)
            else exc
        )
        with stop_signals_held():
            stop_epoch(ref, names, f"{type(stop).__name__} in the flow process")
        if stop is not exc:
            raise stop from None
        raise
    return future.result()


def stop_epoch(ref: Any, names: WorkerNames, reason: str) -> None:
    """Stop the run's running `fit_epoch` (its Ray task `ref`) without `ray.cancel`: ask it to stop before its next
    step; if it has not ended after `STOP_REQUEST_GRACE_S` (a step blocked in an actor call), kill the run's actors,
    which ends that call, and give it `STOP_UNWIND_WAIT_S` to unwind."""
    import ray

    from omni_core.distributed.run_control import kill_run_actors, request_stop

    with contextlib.suppress(Exception):
        request_stop(names, reason)
        ready, _ = ray.wait([ref], timeout=STOP_REQUEST_GRACE_S)
        if not ready:
            kill_run_actors(names, keep_control=True)  # the control actor stays: its answer marks the failure as the stop
            ray.wait([ref], timeout=STOP_UNWIND_WAIT_S)


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """Within: SIGTERM and SIGINT are recorded instead of handled; on exit the handlers are put back and the first
    one recorded is raised again, so it lands after the block. Outside the main thread (where Python runs no
    signal handler) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: held.append(signum)) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if held:
            signal.raise_signal(held[0])


def run_actor_names(flow_run_id: Any, namespace: str) -> list[str]:
    """Named actors of the run of `flow_run_id` in `namespace` (their names carry `<experiment>-<first 8 of the
    flow run id>`: `omni_core.records.WorkerNames`); the hook knows the flow run, not the experiment's name."""
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

    from omni_core.distributed import ray_cluster

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
