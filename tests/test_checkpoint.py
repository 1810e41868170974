"""Checkpoints: atomic commit, manifest, retention, resume resolution, weights-only loading, RunLock, RNG."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from omni_core.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    RunLock,
    RunLockError,
    apply_retention,
    begin,
    capture_rng_state,
    checkpoint_summary,
    cleanup_partial,
    commit,
    find_latest,
    read_lock,
    read_manifest,
    read_state,
    read_tensors,
    read_torch_state,
    resolve_resume,
    restore_rng_state,
    verify_checkpoint,
    write_config,
    write_state,
    write_tensors,
    write_torch_state,
)

REPO = Path(__file__).resolve().parents[1]


def _save(root: Path, step: int) -> Path:
    """One full checkpoint the way a run writes it: the actor's files plus controller state."""
    tmp = begin(root, step)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    write_tensors(tmp / "actor", "model", model.state_dict())  # what the training actor writes itself
    write_torch_state(tmp / "actor", "optimizer", opt.state_dict())
    write_state(tmp, "dataloader", {"epoch": step // 10, "position": step % 10})
    write_state(tmp, "controller", {"global_step": step})
    write_config(tmp, f"trainer:\n  total_epochs: {step}\n")
    return commit(root, tmp, step)


def test_commit_layout_latest_and_round_trip(tmp_path):
    root = tmp_path / "ckpt"
    path = _save(root, 10)
    assert path == root / "global_step_10"
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "10"
    assert sorted(p.name for p in root.iterdir()) == ["global_step_10", "latest_checkpointed_iteration.txt"]
    assert {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} == {
        "actor/model.safetensors",
        "actor/optimizer.pt",
        "dataloader.json",
        "controller.json",
        "config.yaml",
        "manifest.json",
    }
    assert read_state(path, "controller") == {"global_step": 10}
    assert set(read_tensors(path / "actor", "model")) == {"weight", "bias"}
    opt_state = read_torch_state(path / "actor", "optimizer")
    assert opt_state["param_groups"][0]["lr"] == 1e-3 and opt_state["state"][0]["step"].item() == 1
    assert find_latest(root) == path


def test_manifest_hashes_match_files(tmp_path):
    path = _save(tmp_path, 3)
    manifest = read_manifest(path)
    assert manifest["step"] == 3 and manifest["created"]
    for entry in manifest["files"]:
        data = (path / entry["path"]).read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest() and entry["size"] == len(data)
    assert len(manifest["files"]) == 5 and manifest["total_bytes"] == sum(e["size"] for e in manifest["files"])
    summary = checkpoint_summary(path)
    assert summary["step"] == 3 and summary["size_bytes"] == manifest["total_bytes"]
    assert summary["sha256"] == hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()
    verify_checkpoint(path)
    (path / "dataloader.json").write_text('{"epoch": 99}')
    with pytest.raises(CheckpointError, match=r"dataloader.json has \d+ bytes, the manifest \d+ \(truncated or rewritten\)"):
        verify_checkpoint(path)


def test_crash_before_commit_keeps_previous_latest(tmp_path):
    first = _save(tmp_path, 5)
    tmp = begin(tmp_path, 10)  # the run dies while the actor is still writing step 10
    write_state(tmp, "controller", {"global_step": 10})
    (tmp / "actor").mkdir()
    (tmp / "actor" / "model.safetensors").write_bytes(b"half")
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "5"
    assert find_latest(tmp_path) == first
    assert resolve_resume(tmp_path, "auto") == first
    # Without the latest file, the scan also ignores the tmp folder and any global_step_N without manifest.
    (tmp_path / "latest_checkpointed_iteration.txt").unlink()
    (tmp_path / "global_step_20").mkdir()
    assert find_latest(tmp_path) == first
    assert cleanup_partial(tmp_path) == [tmp]
    assert not tmp.exists() and first.is_dir()


def test_crash_during_commit_rename_keeps_previous_latest(tmp_path, monkeypatch):
    first = _save(tmp_path, 5)
    tmp = begin(tmp_path, 6)
    write_state(tmp, "controller", {"global_step": 6})

    def crash(*args):
        raise OSError("disk gone")

    monkeypatch.setattr("omni_core.checkpoint.writer.os.rename", crash)
    with pytest.raises(OSError, match="disk gone"):
        commit(tmp_path, tmp, 6)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "5"  # latest moves only after the rename
    assert find_latest(tmp_path) == first and not (tmp_path / "global_step_6").exists()


def test_latest_pointing_at_missing_step_falls_back_to_scan(tmp_path):
    _save(tmp_path, 1)
    second = _save(tmp_path, 2)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    assert find_latest(tmp_path) == second
    assert find_latest(tmp_path / "nothing-here") is None


def test_writer_aborts_when_not_committed(tmp_path):
    with CheckpointWriter(tmp_path, 4) as w:
        w.write_state("controller", {"global_step": 4})
        tmp = w.tmp
        assert tmp.name == f".tmp_global_step_4_{os.getpid()}"
    assert not tmp.exists() and find_latest(tmp_path) is None
    with CheckpointWriter(tmp_path, 4) as w:
        w.write_state("controller", {"global_step": 4})
        (w.actor_dir / "weights.bin").write_bytes(b"\0" * 8)
        w.commit()
    assert find_latest(tmp_path) == w.path == tmp_path / "global_step_4"


def test_retention_keeps_protected_and_latest(tmp_path):
    for step in (1, 2, 3, 4, 5):
        _save(tmp_path, step)
    deleted = apply_retention(tmp_path, max_keep=2, protect={2})
    assert sorted(p.name for p in deleted) == ["global_step_1", "global_step_3"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("global_step_")) == [
        "global_step_2",
        "global_step_4",
        "global_step_5",
    ]
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")  # e.g. a resumed run at step 2
    assert apply_retention(tmp_path, max_keep=1, protect=set()) == [tmp_path / "global_step_4"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("global_step_")) == ["global_step_2", "global_step_5"]
    assert apply_retention(tmp_path, max_keep=None, protect=set()) == []
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp_")]


def test_resolve_resume_modes(tmp_path):
    root = tmp_path / "run"
    assert resolve_resume(root, "auto") is None  # nothing saved yet: start fresh
    first = _save(root, 1)
    _save(root, 2)
    assert resolve_resume(root, "disable") is None
    assert resolve_resume(root, "auto") == root / "global_step_2"
    assert resolve_resume(root, "resume_path", str(first)) == first
    with pytest.raises(CheckpointError, match="needs trainer.resume_from_path"):
        resolve_resume(root, "resume_path", None)
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_resume(root, "resume_path", str(root / "global_step_9"))
    with pytest.raises(CheckpointError, match="is not a checkpoint.*use trainer.resume_mode=auto"):
        resolve_resume(root, "resume_path", str(root))
    (root / "global_step_3").mkdir()
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        resolve_resume(root, "resume_path", str(root / "global_step_3"))
    with pytest.raises(ValueError, match="not one of auto, disable, resume_path"):
        resolve_resume(root, "latest")


class _Payload:  # any non-state-dict object; unpickling such a file could run arbitrary code
    def __init__(self):
        self.command = "rm -rf /"


def test_weights_only_load_refuses_pickled_objects(tmp_path):
    torch.save({"state": {}, "payload": _Payload()}, tmp_path / "optimizer.pt")
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        read_torch_state(tmp_path, "optimizer")


def test_state_must_be_json(tmp_path):
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        write_state(tmp_path, "controller", {"x": float("nan")})
    with pytest.raises(ValueError, match="relative path inside"):
        write_state(tmp_path, "../escape", {})


# -------------------------------------------------------------------------------------- RunLock
_HOLDER = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[2])
    from omni_core.checkpoint import RunLock
    with RunLock(sys.argv[1], run_id="first-run"):
        print("ready", flush=True)
        sys.stdin.read()  # hold until the test closes our stdin
""")


def test_runlock_refuses_live_holder_and_takes_over_after_it_dies(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path), str(REPO)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(RunLockError, match=rf"in use by run 'first-run' \(pid {holder.pid} .*trainer.experiment_name"):
            RunLock(tmp_path, run_id="second-run").acquire()
    finally:
        holder.kill()  # dies without releasing: the lock file stays behind, stale
        holder.wait(timeout=10)
    assert read_lock(tmp_path / ".omniflow.lock")["pid"] == holder.pid
    with RunLock(tmp_path, run_id="second-run") as lock:
        assert lock.previous_holder["run_id"] == "first-run"
        assert read_lock(lock.path)["run_id"] == "second-run"
    assert not (tmp_path / ".omniflow.lock").exists()


def test_runlock_takes_over_lock_of_finished_pid(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    dead_pid = int(done.stdout)
    (tmp_path / ".omniflow.lock").write_text(
        json.dumps({"pid": dead_pid, "host": os.uname().nodename, "run_id": "crashed", "started": "2024-01-01T00:00:00+00:00"})
    )
    lock = RunLock(tmp_path, run_id="fresh").acquire()
    assert lock.previous_holder["pid"] == dead_pid
    with pytest.raises(RunLockError, match="in use by run 'fresh'"):  # a second run in this process is refused too
        RunLock(tmp_path, run_id="other").acquire()
    lock.release()
    RunLock(tmp_path, run_id="other").acquire().release()


# ------------------------------------------------------------------------------------------ RNG
def test_rng_state_round_trips_through_json():
    import numpy as np  # a dependency of torch and diffusers: always installed

    state = json.loads(json.dumps(capture_rng_state()))
    expected = (random.random(), torch.rand(3).tolist(), np.random.rand(2).tolist())
    random.seed(123)
    torch.manual_seed(123)
    np.random.seed(123)
    restore_rng_state(state)
    assert (random.random(), torch.rand(3).tolist(), np.random.rand(2).tolist()) == expected


def test_a_resume_point_at_the_runs_last_step_is_finished_unless_damaged_or_val_only(tmp_path):
    """`finished_step`: 10 prompts in batches of 4 are 2 steps an epoch (the partial batch dropped), so 3 epochs end at
    step 6; a checkpoint at step 6 is finished, one at 4 is not, nor is step 6 for a val_only run or a run of 4 epochs
    (8 steps); a damaged step-6 file of the same size (found only by hashing) makes step 4 the resume point: not finished.
    """
    from omni_core.config import load_config
    from omni_core.trainers.run_length import finished_step

    root = tmp_path / "ckpt"
    _save(root, 4)
    last = _save(root, 6)
    base = [f"trainer.default_local_dir={root}", "data.train_batch_size=4", "trainer.total_epochs=3"]
    config = load_config(overrides=base)
    assert finished_step(config, str(last), 10) == 6
    assert finished_step(config, str(root / "global_step_4"), 10) is None
    assert finished_step(load_config(overrides=[*base, "trainer.val_only=true"]), str(last), 10) is None
    assert finished_step(load_config(overrides=[*base, "trainer.total_epochs=4"]), str(last), 10) is None
    assert finished_step(load_config(overrides=[*base, "trainer.total_training_steps=5"]), str(last), 10) == 6
    weights = last / "actor" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert finished_step(config, str(last), 10) is None
