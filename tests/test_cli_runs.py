"""The real entry point in its own process: `omniflow train key=value ...`.

A run SIGKILLed (whole process group) after its first checkpoint and started again with
resume_mode=auto ends with the weights of the uninterrupted run; SIGTERM stops a run cleanly and
leaves no Ray or Prefect process behind.
"""

from __future__ import annotations

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


def _wait_for(predicate, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"run exited ({proc.returncode}) before the condition; log:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"condition not met in {timeout_s}s; log:\n{log.read_text()[-3000:]}")


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


@pytest.fixture(scope="module")
def reference_weights(flow_reference):
    """Weights of the uninterrupted in-process run: a run in another process must match them."""
    return final_weights(flow_reference[2])


def test_sigkilled_run_resumes_to_identical_weights(flow_overrides, tmp_path, prefect_api, reference_weights):
    ckpt = tmp_path / "ckpt"
    overrides = [*flow_overrides, f"trainer.default_local_dir={ckpt}"]
    env = _env(PREFECT_API_URL=prefect_api)

    first = _train(overrides, env, tmp_path / "first.log")
    _wait_for(lambda: (ckpt / "global_step_1" / "manifest.json").exists(), first, 600, tmp_path / "first.log")
    children = _descendants(first.pid)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=60)
    for p in children:  # Ray's own daemons may outlive the group; they belong to the killed run
        if p.is_running():
            p.kill()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() in ("1", "2")

    second = _train(overrides, env, tmp_path / "second.log")  # resume_mode=auto is the default
    assert second.wait(timeout=600) == 0, (tmp_path / "second.log").read_text()[-3000:]
    assert_same_weights(final_weights(ckpt), reference_weights)


def test_sigterm_stops_cleanly_and_leaves_no_process(flow_overrides, tmp_path):
    """No PREFECT_API_URL: the run starts its own Prefect server and Ray cluster, and must stop both."""
    ckpt = tmp_path / "ckpt"
    log = tmp_path / "run.log"
    env = _env(PREFECT_HOME=str(tmp_path / "prefect-home"))
    env.pop("PREFECT_API_URL", None)
    proc = _train([*flow_overrides, f"trainer.default_local_dir={ckpt}", "trainer.total_epochs=3"], env, log)
    _wait_for(lambda: (ckpt / "global_step_1" / "manifest.json").exists(), proc, 600, log)
    spawned = _descendants(proc.pid)
    names = " ".join(" ".join(p.cmdline()) for p in spawned if p.is_running())
    assert "raylet" in names and "prefect" in names and "server" in names  # what must go away

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) != 0
    time.sleep(5)
    alive = [p for p in spawned if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [" ".join(p.cmdline())[:120] for p in alive]
    text = log.read_text()
    # Where the signal lands decides the wording (an interruption, or a crashed / failed flow state).
    assert "interrupted; the last checkpoint is intact" in text or "omniflow: run " in text
    assert "Starting temporary server" not in text  # one API for the whole run, never an ephemeral one

    from omni_core.checkpoint import find_latest, verify_checkpoint

    latest = find_latest(ckpt)
    assert latest is not None
    verify_checkpoint(latest)  # intact: every file matches its manifest hash
