"""A service of the run dies mid-run, and the run is stopped at several points: `omniflow train` in its own process.

The embedded Prefect API, in a separate_async run: the run stops at once with one line naming the dead server
and how to resume (exit 75), leaves no Ray, TransferQueue or Prefect process behind and its last checkpoint
intact, and the same command again starts a new server on the same PREFECT_HOME and resumes from that
checkpoint. That second run, and two more started by the same command, are then stopped (`STOPS`): SIGTERM as an
epoch ends (as a shell's kill or a scheduler's stop does), Ctrl-C mid-step, SIGTERM while a checkpoint is written.
Each stop: exit 130, the interruption line and nothing else alarming on the console (no traceback, no Ray abort),
its server, Ray cluster and rollout worker gone, its last checkpoint intact (with the group it sampled ahead), and
the next run resumes right after it. (One test: each run that starts its own Ray cluster costs half a minute or
more on 2 cores.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import psutil
import pytest
from real_prefect import wait_gone
from test_cli_runs import _descendants, _env, _latest, _step_records, _train, _wait_for
from test_security import assert_listens_on_loopback_only

from omni_core.checkpoint import read_state

pytestmark = pytest.mark.timeout(900)


def _own_api_run(flow_overrides: list[str], tmp_path, ckpt) -> tuple[dict[str, str], list[str]]:
    """Environment and overrides of an 8-step separate_async run (a rollout worker sampling one batch ahead, so a
    stop must also stop it and a resume must put back the group its checkpoint holds) that starts its own Prefect
    API server and Ray cluster."""
    from test_separate_async import ASYNC

    env = _env(PREFECT_HOME=str(tmp_path / "prefect-home"))
    env.pop("PREFECT_API_URL", None)
    env.pop("PREFECT_RESULTS_LOCAL_STORAGE_PATH", None)  # under this run's own PREFECT_HOME
    return env, [*flow_overrides, *ASYNC, f"trainer.default_local_dir={ckpt}", "trainer.total_epochs=4"]


def test_a_killed_prefect_api_stops_the_run_cleanly_and_the_next_run_resumes(flow_overrides, tmp_path, prefect_api):
    from omniflow.flows.runner import EXIT_API_DIED

    from omni_core.checkpoint import find_latest, verify_checkpoint

    ckpt = tmp_path / "ckpt"
    env, overrides = _own_api_run(flow_overrides, tmp_path, ckpt)

    first_log = tmp_path / "first.log"
    proc = _train(overrides, env, first_log)
    _wait_for(lambda: _latest(ckpt) == "1", proc, 600, first_log)
    spawned = [p for p in _descendants(proc.pid) if p.is_running()]
    (server,) = [p for p in spawned if "prefect" in " ".join(p.cmdline()) and "server" in p.cmdline()]
    assert any("raylet" in " ".join(p.cmdline()) for p in spawned)  # what must go away with the run
    os.kill(server.pid, signal.SIGKILL)

    code = proc.wait(timeout=120)
    text = first_log.read_text()
    assert code == EXIT_API_DIED, text[-3000:]
    assert f"omniflow: the run's Prefect API server (pid {server.pid}, " in text, text[-3000:]
    assert "the run is stopped and its last checkpoint is intact: run the same command again to resume from it" in text
    wait_gone(spawned, timeout_s=60)  # Ray's cluster, TransferQueue's actors and the run's workers share its fate
    latest = find_latest(ckpt)
    assert latest is not None and latest.name in ("global_step_1", "global_step_2"), latest
    verify_checkpoint(latest)  # intact: every file matches its manifest hash

    # The same command again: a new server on the same PREFECT_HOME, resumed from that checkpoint. It and the runs
    # after it are then stopped at three points of the run, each resumed by the same command.
    # (The third and fourth use the session's API, as a user's PREFECT_API_URL: a server start less each.)
    resumed_at = int(latest.name.removeprefix("global_step_"))
    for n, (point, sig) in enumerate(STOPS, start=2):
        run_env = env if n == 2 else _env(PREFECT_API_URL=prefect_api)
        resumed_at = _stop_at(point, sig, overrides, run_env, ckpt, tmp_path / f"run{n}.log", resumed_at, own_api=n == 2)


# Where the resumed runs are stopped: at the end of an epoch (the flow's wait returns as the epoch's task completes,
# and the signal is handled right then: the moment where a `ray.cancel` aborted the process), by Ctrl-C in the
# middle of a step (SIGINT to the whole process group, as a terminal sends it), and while a checkpoint is written.
STOPS = [("epoch_end", signal.SIGTERM), ("mid_step", signal.SIGINT), ("checkpoint_write", signal.SIGTERM)]


def _stop_at(point: str, sig: int, overrides: list[str], env: dict[str, str], ckpt, log, resumed_at: int, own_api: bool) -> int:
    """Start the run (same command), check it resumed after `resumed_at`, send `sig` at `point`; check the stop:
    exit 130, the interruption line, no traceback or Ray abort on the console, its processes gone, its last
    checkpoint intact. Returns that checkpoint's step."""
    from omni_core.checkpoint import find_latest, verify_checkpoint
    from omni_core.checkpoint.layout import TMP_PREFIX

    before, entries = set((ckpt / "logs").iterdir()), {p.name for p in ckpt.iterdir()}
    proc = _train(overrides, env, log)
    # Its processes are read while it goes, so that the signal is sent the moment its point is reached.
    tree = _ProcessTree(proc.pid, check_listening=own_api)
    if point == "epoch_end":  # the next even step ends an epoch (2 steps each)
        target = resumed_at + 2 - resumed_at % 2
        _wait_for(lambda: _latest(ckpt) == str(target), proc, 600, log, poll_s=0.01)
    elif point == "mid_step":
        _wait_for(lambda: _latest(ckpt) == str(resumed_at + 1), proc, 600, log, poll_s=0.01)
        time.sleep(0.3)  # into the next step
    else:
        writing = lambda: any(p.name.startswith(TMP_PREFIX) and p.name not in entries for p in ckpt.iterdir())  # noqa: E731
        _wait_for(writing, proc, 600, log, poll_s=0.005)  # a new temporary folder: this run's writer, not a leftover
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # Ctrl-C: the terminal signals the whole foreground process group
    else:
        proc.send_signal(sig)
    spawned = tree.stop()
    names = " ".join(cmdline for cmdline in spawned.values())
    assert "raylet" in names and "RolloutWorker" in names  # what must go away (the rollout worker samples ahead)
    assert any("prefect" in cmdline and " server" in cmdline for cmdline in spawned.values()) == own_api
    code = proc.wait(timeout=120)
    text = log.read_text()
    assert code == 130, text[-3000:]
    assert "omniflow: interrupted; the last checkpoint is intact and the run's processes are stopped" in text, text[-3000:]
    for noise in ("Traceback", "Check failed", "StackTrace", "Error"):  # the console shows the stop, nothing else
        assert noise not in text, (point, text[-3000:])
    assert "Starting temporary server" not in text  # one API for the whole run, never an ephemeral one
    wait_gone(list(spawned), timeout_s=60)
    (run_logs,) = set((ckpt / "logs").iterdir()) - before
    assert _step_records(run_logs)[0] == resumed_at + 1  # it resumed: only the steps after the checkpoint
    kept = run_logs / "ray"  # Ray's own logs (the cluster this run started), kept with the run's metrics
    assert (kept / "gcs_server.out").is_file() and any(kept.glob("python-core-driver-*.log")), list(kept.glob("*"))
    latest = find_latest(ckpt)
    assert latest is not None, point
    verify_checkpoint(latest)  # intact: every file matches its manifest hash
    assert read_state(latest, "rollout_queue")["groups"] == 1  # the next step's group, sampled ahead and recorded
    return int(latest.name.removeprefix("global_step_"))


class _ProcessTree:
    """Every process a run has had (with its latest command line), read by a thread every 0.1 s from the run's start to
    `stop()`: a scan of the tree after the stop point was reached took long enough on a busy machine for the run to
    end first (it has a few 0.2 s steps left). With `check_listening`, the thread also checks, once the run's
    cluster is up, that the processes the run started listen on loopback only (test_security's check, on this run);
    `stop()` raises that check's error if it never passed."""

    def __init__(self, pid: int, check_listening: bool) -> None:
        self.pid, self.seen = pid, {}
        self.listening: AssertionError | None = (
            AssertionError("the run's cluster was not up before the stop") if check_listening else None
        )
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._done.wait(0.1):
            for p in _descendants(self.pid):
                with contextlib.suppress(psutil.Error):  # read again each time: a Ray worker starts as `ray::IDLE`
                    self.seen[p] = " ".join(p.cmdline()) or self.seen.get(p, "")  # and takes its actor's name later
            if self.listening is not None and "RolloutWorker" in " ".join(self.seen.values()):
                try:
                    assert_listens_on_loopback_only([psutil.Process(self.pid), *self.seen])
                    self.listening = None
                except AssertionError as error:  # e.g. a TransferQueue actor not listening yet: read again
                    self.listening = error

    def stop(self) -> dict[psutil.Process, str]:
        self._done.set()
        self._thread.join(timeout=60)
        if self.listening is not None:
            raise self.listening
        return self.seen
