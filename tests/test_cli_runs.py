"""The real entry point in its own process: `omniflow train key=value ...`.

A sync run on two data-parallel ranks, epochs of two steps and a checkpoint after every step, SIGKILLed (with every
process it started) right after its first checkpoint, inside epoch 1, and started again with resume_mode=auto: it
trains only steps 2-4 (the rest of epoch 1 from the saved dataloader position, then epoch 2) and ends with the weights
of the uninterrupted run, bit for bit, its lr schedule included. (A resume at an epoch's end, from a new run's fresh
actors: test_checkpoint_faults' damaged-folder run and test_data_parallel's fsdp2 run. SIGTERM: test_api_faults. One
rank's resume is the same path with a world of one; its resumes in one process are checked bit for bit in
test_process_faults.)
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

# The group: shares that session run with other modules (conftest).
pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("mid_epoch_reference")]


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
    env.pop("RAY_ADDRESS", None)
    return env


def _as_a_terminal_job() -> None:
    """Run in the child before exec: Ctrl-C does what it does to a command typed in a terminal. A shell starts a
    background job (`make test &`, a nohup'd loop) with SIGINT ignored, an ignored signal stays ignored across exec,
    and Python then never raises KeyboardInterrupt: a Ctrl-C test would see the run go on to its end."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _train(overrides: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "omniflow.flows.main_diffusion_v1", *overrides],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,  # its own process group, as a shell job would be
        preexec_fn=_as_a_terminal_job,
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
def mid_epoch_reference(flow_overrides, prefect_api, ray_cluster, transfer_queue, tmp_path_factory) -> Path:
    from flow_utils import run_mid_epoch_reference

    return run_mid_epoch_reference(flow_overrides, tmp_path_factory)


def test_a_run_sigkilled_mid_epoch_resumes_to_identical_weights(
    flow_overrides, tmp_path, prefect_api, ray_cluster, transfer_queue, mid_epoch_reference
):
    """Two data-parallel ranks (gloo), killed between step 1's checkpoint and step 2's (epoch 1 has steps 1 and 2): the
    resumed run ends with the uninterrupted two-rank run's weights, bit for bit."""
    from flow_utils import MID_EPOCH

    from omni_core.checkpoint import read_state

    reference_weights = final_weights(mid_epoch_reference)
    ckpt = tmp_path / "ckpt"
    overrides = [*flow_overrides, *MID_EPOCH, f"trainer.default_local_dir={ckpt}"]
    env = _env(PREFECT_API_URL=prefect_api)

    first = _train(overrides, env, tmp_path / "first.log")
    # Killed as soon as step 1 is committed: step 2 (the epoch's second rollout, an update and a save) is seconds away.
    _wait_for(lambda: _latest(ckpt) == "1", first, 600, tmp_path / "first.log", poll_s=0.05)
    _freeze_and_kill(first.pid)
    first.wait(timeout=60)
    assert _latest(ckpt) == "1" and not (ckpt / "global_step_2").exists(), "the kill landed after step 2 was saved"
    loader = read_state(ckpt / "global_step_1", "dataloader")
    assert (loader["epoch"], loader["position"]) == (0, 1)  # saved inside epoch 1, after its first batch
    first_logs = set((ckpt / "logs").iterdir())
    # The killed run trained step 1 only. A checkpoint inside an epoch is saved within its step, before the step's
    # metrics record is written (as verl does: the record carries timing_s/save_checkpoint), so that record may be lost.
    assert [_step_records(d) for d in first_logs] in ([[1]], [[]])

    # The same config again (resume_mode=auto is the default), in this process on the session's cluster: the kill
    # needs a run in a process of its own, the resume does not, and a fresh process would add a Ray cluster's start.
    from omniflow.flows.main_diffusion_v1 import main_diffusion_v1

    state = main_diffusion_v1(overrides=overrides, return_state=True)
    assert state.is_completed(), state.message
    # It resumed: its own metrics (a new run id, a new log folder) hold steps 2-4 only; step 1 came from the checkpoint.
    (second_logs,) = set((ckpt / "logs").iterdir()) - first_logs
    assert _step_records(second_logs) == [2, 3, 4]
    assert _latest(ckpt) == "4"
    # It finished epoch 1 first (its end saved step 2), then ran epoch 2; retention kept the last three checkpoints.
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("global_step_")) == [f"global_step_{s}" for s in (2, 3, 4)]
    assert_same_weights(final_weights(ckpt), reference_weights)
