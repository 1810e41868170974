"""Stopping a running epoch (`flows/cancellation.py`, `omni_core/distributed/run_control.py`) never aborts the flow process.

The race: a stop signal that arrives while the flow waits for an epoch is handled when the wait returns, often the
moment the epoch's task completes. `ray.cancel` in that window aborted the process in Ray 2.60 (a C++ check in
task_manager.cc: "Tried to complete task that was not pending"): with `ray.cancel` in `stop_epoch`, the loop below
aborted within 2 to 11 tries (three runs on 2 cores). `stop_epoch` now asks the run's control actor instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# A flow process stand-in that joins the session's cluster: 40 times, a short epoch-like task is stopped from a signal
# handler that fires in the last tenth of a second before the task ends, the way `wait_for_epoch` stops an epoch.
# (The stand-in has no control actor: `stop_epoch`'s request finds none, and it waits for the task's end.)
_RACE = textwrap.dedent(
    """
    import os, random, signal, sys, threading, time
    import ray
    from omni_core.records import WorkerNames
    from omniflow.flows.cancellation import stop_epoch

    ray.init(address=sys.argv[1], namespace="omniflow-tests-stopping", log_to_driver=False)

    @ray.remote(num_cpus=0, max_retries=0)
    def epoch(seconds):
        time.sleep(seconds)
        return "completed"

    class Stop(Exception):
        pass

    def on_signal(signum, frame):
        raise Stop()

    signal.signal(signal.SIGUSR1, on_signal)
    rng = random.Random(0)
    ray.get(epoch.remote(0.0))  # a warm worker
    stopped = 0
    for i in range(40):
        seconds = 0.12
        ref = epoch.remote(seconds)
        fired = threading.Event()

        def fire():
            os.kill(os.getpid(), signal.SIGUSR1)
            fired.set()

        threading.Timer(seconds - rng.uniform(0.0, 0.1), fire).start()
        try:
            while not ray.wait([ref], timeout=0.5)[0]:
                pass
            fired.wait(timeout=60)  # a late signal (a busy machine) still lands in this try
            time.sleep(0.05)
        except BaseException as exc:  # Stop, or a SystemError caused by it when it lands inside ray.wait's C call
            assert isinstance(exc, Stop) or isinstance(exc.__cause__, Stop), repr(exc)
            stop_epoch(ref, WorkerNames("omniflow-tests-stopping", f"race-{i:04d}"), "SIGUSR1")
            stopped += 1
        assert ray.get(ref, timeout=30) == "completed"
    print("STOPPED", stopped)
    """
)


def test_stopping_an_epoch_as_it_completes_never_aborts_the_flow_process(ray_cluster):
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    env.pop("RAY_ADDRESS", None)
    address = ray_cluster.get_runtime_context().gcs_address
    out = subprocess.run([sys.executable, "-c", _RACE, address], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "Check failed" not in out.stderr, out.stderr[-4000:]
    assert "STOPPED 40" in out.stdout, out.stdout[-2000:]  # every try was stopped, and its task still completed


@pytest.fixture
def control(ray_cluster):
    from omni_core.distributed.run_control import kill_run_actors, start_run_control
    from omni_core.records import WorkerNames

    names = WorkerNames("omniflow-tests", "stopping-0001")
    handle = start_run_control(names)  # owned here: the actor lives while this handle does
    yield names
    kill_run_actors(names)
    del handle


def _wait_for_file(path, timeout_s: float = 120.0) -> None:
    """Poll (with a deadline) for a file a Ray task writes when it has started: a worker may take seconds to start."""
    import time

    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout_s} s"
        time.sleep(0.05)


def test_a_stop_request_ends_an_epoch_before_its_next_step(control, tmp_path):
    """An epoch that would run for a minute ends with `RunStopRequested` (never retried) within `stop_epoch`'s wait."""
    import ray
    from omniflow.flows.cancellation import stop_epoch

    from omni_core.distributed.run_control import RunStopRequested, raise_if_stop_requested
    from omni_core.faults import is_retryable

    @ray.remote(num_cpus=0, max_retries=0)
    def epoch(names, started):
        import time

        started.touch()
        for step in range(60 * 100):
            raise_if_stop_requested(names, f"before step {step + 1}")
            time.sleep(0.01)
        return "completed"

    ref = epoch.remote(control, tmp_path / "started")
    _wait_for_file(tmp_path / "started")
    stop_epoch(ref, control, "a test")
    assert ray.wait([ref], timeout=0)[0], "stop_epoch returned with the epoch still running"
    with pytest.raises(RunStopRequested, match="stopped before step [0-9]+: a test") as err:
        ray.get(ref)
    assert not is_retryable(err.value)


def test_a_step_blocked_in_an_actor_call_ends_when_the_stop_kills_the_run_actors(control, tmp_path):
    """A step that waits on a run actor (an update that would take a minute) does not see the request; after
    `STOP_REQUEST_GRACE_S` the run's actors are killed, the call fails, and the failure is the stop, not a dead actor
    to retry. The control actor itself survives until the run closes."""
    import ray
    from omniflow.flows.cancellation import STOP_REQUEST_GRACE_S, STOP_UNWIND_WAIT_S, stop_epoch

    from omni_core.distributed.run_control import RunStopRequested, raise_if_stop_requested, run_actor_names
    from omni_core.faults import is_retryable

    @ray.remote(num_cpus=0, max_restarts=0)
    class Rank:
        def update(self, started) -> str:
            import time

            started.touch()
            time.sleep(60)
            return "updated"

    rank = Rank.options(name=f"omniflow-{control.run_id}-training-actor", namespace=control.namespace).remote()

    @ray.remote(num_cpus=0, max_retries=0)
    def epoch(names, rank, started):
        try:
            return ray.get(rank.update.remote(started), timeout=120)
        except Exception:
            raise_if_stop_requested(names, "during step 1")
            raise

    ref = epoch.remote(control, rank, tmp_path / "started")
    _wait_for_file(tmp_path / "started")  # the step is in the actor call
    stop_epoch(ref, control, "a test")
    assert ray.wait([ref], timeout=0)[0], f"the epoch did not end within {STOP_REQUEST_GRACE_S + STOP_UNWIND_WAIT_S} s"
    with pytest.raises(RunStopRequested, match="stopped during step 1: a test") as err:
        ray.get(ref)
    assert not is_retryable(err.value)
    assert run_actor_names(control) == [control.run_control]  # the rank is gone, the request stays readable


def test_an_epoch_past_its_deadline_is_stopped_and_reported_as_a_timeout_not_retried(control, tmp_path):
    """`trainer.epoch_timeout_s`: the flow's wait for an epoch that would run for a minute passes its deadline, stops
    the epoch the way a cancel does (it ends with `RunStopRequested`), and raises `EpochDeadlinePassed`, which the
    flow turns into an `EpochTimeoutError` naming the key; neither is retried. Without a deadline the same wait
    returns the epoch's result."""
    import time
    from types import SimpleNamespace

    import ray
    from omniflow.flows.cancellation import STOP_REQUEST_GRACE_S, EpochDeadlinePassed, wait_for_epoch

    from omni_core.distributed.run_control import RunStopRequested, raise_if_stop_requested
    from omni_core.faults import epoch_timeout_error, is_retryable

    @ray.remote(num_cpus=0, max_retries=0)
    def epoch(names, started, steps):
        started.touch()
        for step in range(steps):
            raise_if_stop_requested(names, f"before step {step + 1}")
            time.sleep(0.01)
        return "completed"

    def future(ref):  # what wait_for_epoch reads of prefect-ray's future
        return SimpleNamespace(wrapped_future=ref, result=lambda: ray.get(ref))

    done = epoch.remote(control, tmp_path / "short", 5)
    assert wait_for_epoch(future(done), control) == "completed"

    ref = epoch.remote(control, tmp_path / "started", 60 * 100)
    _wait_for_file(tmp_path / "started")
    start = time.monotonic()
    with pytest.raises(EpochDeadlinePassed):
        wait_for_epoch(future(ref), control, deadline=start + 1.0)
    assert time.monotonic() - start < 1.0 + STOP_REQUEST_GRACE_S + 5.0
    assert ray.wait([ref], timeout=0)[0], "the epoch was still running after the deadline"
    with pytest.raises(RunStopRequested, match="time bound"):
        ray.get(ref)
    error = epoch_timeout_error(3, 7200.0)
    assert "epoch 3 ran past trainer.epoch_timeout_s=7200 s" in str(error) and "null" in str(error)
    assert not is_retryable(error)
