"""A service of the run dies mid-run: `omniflow train` in its own process, the service's process SIGKILLed.

The embedded Prefect API, in a separate_async run: the run stops at once with one line naming the dead server
and how to resume (exit 75), leaves no Ray, TransferQueue or Prefect process behind and its last checkpoint
intact, and the same command again starts a new server on the same PREFECT_HOME and resumes from that
checkpoint. That second run is then stopped with SIGTERM (as a shell's kill or a scheduler's stop does): exit
130, the interruption line, its own server, Ray cluster and rollout worker gone, its checkpoint intact (with
the group it sampled ahead). (One test for both: each run that starts its own server and Ray cluster costs a
minute on 2 cores.)
"""

from __future__ import annotations

import os
import signal

import pytest
from real_prefect import wait_gone
from test_cli_runs import _descendants, _env, _latest, _step_records, _train, _wait_for

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


def test_a_killed_prefect_api_stops_the_run_cleanly_and_the_next_run_resumes(flow_overrides, tmp_path):
    from omniflow.flows.runner import EXIT_API_DIED

    from omni_core.checkpoint import find_latest, read_state, verify_checkpoint

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
    first_logs = set((ckpt / "logs").iterdir())

    second_log = tmp_path / "second.log"
    second = _train(overrides, env, second_log)  # the same command: a new server on the same PREFECT_HOME
    resumed_at = int(latest.name.removeprefix("global_step_"))
    _wait_for(lambda: _latest(ckpt) == str(resumed_at + 1), second, 600, second_log)
    (second_logs,) = set((ckpt / "logs").iterdir()) - first_logs
    assert _step_records(second_logs)[0] == resumed_at + 1  # it resumed: only the steps after the checkpoint
    spawned = _descendants(second.pid)
    names = " ".join(" ".join(p.cmdline()) for p in spawned if p.is_running())
    assert "raylet" in names and "prefect" in names and "server" in names  # what must go away
    assert "RolloutWorker" in names  # the standalone rollout worker, sampling ahead while the trainer updates

    # The signal lands while the flow runs, where Prefect's engine turns it into a TerminationSignal and the
    # CLI reports an interruption: one path, one exit code.
    second.send_signal(signal.SIGTERM)
    code = second.wait(timeout=120)
    text = second_log.read_text()
    assert code == 130, text[-3000:]
    assert "omniflow: interrupted; the last checkpoint is intact and the run's processes are stopped" in text, text[-3000:]
    wait_gone(spawned, timeout_s=60)
    assert "Starting temporary server" not in text  # one API for the whole run, never an ephemeral one
    latest = find_latest(ckpt)
    assert latest is not None and int(latest.name.removeprefix("global_step_")) > resumed_at, latest
    verify_checkpoint(latest)
    assert read_state(latest, "rollout_queue")["groups"] == 1  # the next step's group, sampled ahead and recorded
