"""The real entry point in its own process: `omniflow train key=value ...`.

A run SIGKILLed (with every process it started) right after its first checkpoint and started again
with resume_mode=auto trains only the second step and ends with the weights of the uninterrupted run;
SIGTERM stops a run cleanly and leaves no Ray or Prefect process behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from flow_utils import assert_same_weights, final_weights

pytestmark = pytest.mark.timeout(900)


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
    env.pop("RAY_ADDRESS", None)
    return env


def _train(overrides: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "omniflow.flows.main_diffusion_v1", *overrides],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,  # its own process group, as a shell job would be
    )


def _wait_for(predicate, proc: subprocess.Popen, timeout_s: float, log: Path, poll_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"run exited ({proc.returncode}) before the condition; log:\n{log.read_text()[-3000:]}")
        time.sleep(poll_s)
    raise AssertionError(f"condition not met in {timeout_s}s; log:\n{log.read_text()[-3000:]}")


def _latest(ckpt: Path) -> str | None:
    """The step in latest_checkpointed_iteration.txt: written (atomically) after the step's folder is renamed
    into place, so once it names a step, that checkpoint is complete and is what a resume starts from."""
    path = ckpt / "latest_checkpointed_iteration.txt"
    return path.read_text().strip() if path.exists() else None


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _freeze_and_kill(pid: int) -> None:
    """SIGKILL a run and every process it started. Ray's daemons and workers do not all share the run's
    process group, and a worker left running could write the next checkpoint: stop (SIGSTOP) the whole
    tree first, parents before children so that none spawns another, then kill it."""
    frozen: list[psutil.Process] = []
    todo = [psutil.Process(pid)]
    while todo:
        p = todo.pop(0)
        if p in frozen:
            continue
        with contextlib.suppress(psutil.Error):
            p.suspend()
            frozen.append(p)
            todo.extend(p.children())
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    for p in frozen:
        with contextlib.suppress(psutil.Error):
            p.kill()


def _step_records(log_dir: Path) -> list[int]:
    from omni_core.tracking import read_jsonl

    return [r["step"] for r in read_jsonl(log_dir / "metrics.jsonl") if "critic/rewards/mean" in r]


@pytest.fixture(scope="module")
def reference_weights(flow_reference):
    """Weights of the uninterrupted in-process run: a run in another process must match them."""
    return final_weights(flow_reference[2])


@pytest.mark.parametrize("ranks", [1, 2])
def test_sigkilled_run_resumes_to_identical_weights(flow_overrides, tmp_path, prefect_api, request, ranks):
    """One training rank, and two data-parallel ranks (gloo): the resumed run ends with the uninterrupted run's
    weights of the same rank count, bit for bit."""
    from flow_utils import TWO_RANKS

    if ranks == 1:
        reference_weights = request.getfixturevalue("reference_weights")
    else:
        reference_weights = final_weights(request.getfixturevalue("two_rank_reference")[1])
    ckpt = tmp_path / "ckpt"
    overrides = [*flow_overrides, *(TWO_RANKS if ranks == 2 else []), f"trainer.default_local_dir={ckpt}"]
    env = _env(PREFECT_API_URL=prefect_api)

    first = _train(overrides, env, tmp_path / "first.log")
    # Killed as soon as step 1 is committed: step 2 (an epoch of rollouts, an update and a save) is seconds away.
    _wait_for(lambda: _latest(ckpt) == "1", first, 600, tmp_path / "first.log", poll_s=0.05)
    _freeze_and_kill(first.pid)
    first.wait(timeout=60)
    assert _latest(ckpt) == "1" and not (ckpt / "global_step_2").exists(), "the kill landed after step 2 was saved"
    first_logs = set((ckpt / "logs").iterdir())
    assert [_step_records(d) for d in first_logs] == [[1]]  # the killed run trained step 1 only

    second = _train(overrides, env, tmp_path / "second.log")  # resume_mode=auto is the default
    assert second.wait(timeout=600) == 0, (tmp_path / "second.log").read_text()[-3000:]
    # It resumed: its own metrics (a new run id, a new log folder) hold step 2 only; step 1 came from the checkpoint.
    (second_logs,) = set((ckpt / "logs").iterdir()) - first_logs
    assert _step_records(second_logs) == [2]
    assert _latest(ckpt) == "2"
    assert_same_weights(final_weights(ckpt), reference_weights)


def test_sigterm_stops_cleanly_and_leaves_no_process(flow_overrides, tmp_path):
    """No PREFECT_API_URL: the run starts its own Prefect server and Ray cluster, and must stop both."""
    from real_prefect import wait_gone

    ckpt = tmp_path / "ckpt"
    log = tmp_path / "run.log"
    env = _env(PREFECT_HOME=str(tmp_path / "prefect-home"))
    env.pop("PREFECT_API_URL", None)
    env.pop("PREFECT_RESULTS_LOCAL_STORAGE_PATH", None)  # under this run's own PREFECT_HOME
    proc = _train([*flow_overrides, f"trainer.default_local_dir={ckpt}", "trainer.total_epochs=3"], env, log)
    _wait_for(lambda: _latest(ckpt) == "1", proc, 600, log)
    spawned = _descendants(proc.pid)
    names = " ".join(" ".join(p.cmdline()) for p in spawned if p.is_running())
    assert "raylet" in names and "prefect" in names and "server" in names  # what must go away

    # The signal lands while the flow runs (epoch 2 of 3), where Prefect's engine turns it into a
    # TerminationSignal and the CLI reports an interruption: one path, one exit code.
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=120)
    text = log.read_text()
    assert code == 130, text[-3000:]
    assert "omniflow: interrupted; the last checkpoint is intact and the run's processes are stopped" in text, text[-3000:]
    wait_gone(spawned, timeout_s=60)
    assert "Starting temporary server" not in text  # one API for the whole run, never an ephemeral one

    from omni_core.checkpoint import find_latest, verify_checkpoint

    latest = find_latest(ckpt)
    assert latest is not None and latest.name in ("global_step_1", "global_step_2"), latest
    verify_checkpoint(latest)  # intact: every file matches its manifest hash
