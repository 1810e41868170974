"""Stopping a running epoch from the flow process, without `ray.cancel`.

Why not `ray.cancel`: in Ray 2.60 the owner of a task aborts (`task_manager.cc: Check failed: it !=
submissible_tasks_.end() Tried to complete task that was not pending`, a C++ stack trace, the driver gone) when a
cancel reaches it while the task's reply is being handled: the reply handler has taken the task off the
executing list but not yet completed it, so the cancel fails the pending task and the reply then completes a task
that is no longer there. A stop signal that arrives while the flow waits for an epoch is handled when that wait
returns, which is often the very moment the epoch's task completes: the cancel then lands in that window. A loop
of 20-odd such cancels reproduces the abort in seconds (outside OmniFlow, with plain Ray tasks).

Instead a stop is asked for, never forced through Ray's task table:

- `RunControl`, one small actor per run (no CPU reservation, named after the run: `WorkerNames.run_control`),
  holds the request; the trainer checks it before every step (`raise_if_stop_requested`) and ends the epoch
  with `RunStopRequested`, which is never retried (`omni_core.faults`).
- A step that is blocked in an actor call (an update, a rollout, a weight sync) ends when the flow kills the run's
  actors after a grace period (`kill_run_actors`): that call then fails, and a failure after a stop request is
  reported as the stop (`stop_reason`), not retried as a dead actor would be.
"""

from __future__ import annotations

import contextlib
from typing import Any

import ray

from omni_core.records import WorkerNames

# Every wait is bounded (docs/design.md section 7); the control actor answers in milliseconds.
CONTROL_CALL_TIMEOUT_S = 30.0


class RunStopRequested(RuntimeError):
    """The run was asked to stop (Ctrl-C, SIGTERM, a cancellation in the Prefect UI): never retried."""


@ray.remote(num_cpus=0, max_restarts=0)
class RunControl:
    """A run's stop request: set once by the flow process, read by the trainer before each step."""

    def __init__(self) -> None:
        self._reason: str | None = None

    def request_stop(self, reason: str) -> None:
        if self._reason is None:
            self._reason = reason

    def stop_reason(self) -> str | None:
        return self._reason


def start_run_control(names: WorkerNames) -> Any:
    """The run's `RunControl` (created by the process that starts the run; a retried start reuses it). Keep the
    returned handle for the run's lifetime: Ray ends an actor, named or not, once its creator drops every handle."""
    return RunControl.options(name=names.run_control, namespace=names.namespace, get_if_exists=True).remote()


def _handle(names: WorkerNames) -> Any | None:
    try:
        return ray.get_actor(names.run_control, namespace=names.namespace)
    except ValueError:  # never started (library use without `init`) or already closed
        return None


def request_stop(names: WorkerNames, reason: str) -> bool:
    """Ask the run's epoch to stop before its next step; False when the run has no control actor (any more)."""
    handle = _handle(names)
    if handle is None:
        return False
    try:
        ray.get(handle.request_stop.remote(reason), timeout=CONTROL_CALL_TIMEOUT_S)
    except ray.exceptions.RayError:
        return False
    return True


def stop_reason(names: WorkerNames) -> str | None:
    """Why the run was asked to stop, or None (also when its control actor is gone: nothing asked for a stop)."""
    handle = _handle(names)
    if handle is None:
        return None
    try:
        return ray.get(handle.stop_reason.remote(), timeout=CONTROL_CALL_TIMEOUT_S)
    except ray.exceptions.RayError:
        return None


def raise_if_stop_requested(names: WorkerNames, where: str) -> None:
    reason = stop_reason(names)
    if reason is not None:
        raise RunStopRequested(f"stopped {where}: {reason}")


def run_actor_names(names: WorkerNames) -> list[str]:
    """The named actors of the run (`omniflow-<run id>-...`: training ranks, rollout workers, its control actor)."""
    prefix = f"omniflow-{names.run_id}-"
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == names.namespace and a["name"].startswith(prefix)
    ]


def kill_run_actors(names: WorkerNames, keep_control: bool = False) -> list[str]:
    """Kill the run's named actors (the control actor too unless `keep_control`); the names killed."""
    killed = []
    for name in run_actor_names(names):
        if keep_control and name == names.run_control:
            continue
        with contextlib.suppress(ValueError):
            ray.kill(ray.get_actor(name, namespace=names.namespace), no_restart=True)
            killed.append(name)
    return killed
