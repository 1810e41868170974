"""Checkpoint faults with real faults (issue 11, items 1-5 and 14): real folders, a truncated file, a writer
killed by pid, a full tmpfs, a changed config. Mostly omni_core-level (no Ray, no flow run): each fault lives in the
checkpoint folder, so the checks the run makes at start (`resume_point`, `resume_problems`,
`checkpoint_folder_problems`) and the writer are exercised directly, on checkpoints the training actor of the
tiny model writes itself. One flow run (the last test) resumes the same command on a folder damaged all three ways at
once and ends with the uninterrupted run's weights."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from omni_core.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    DiskFullError,
    apply_retention,
    find_latest,
    read_latest_step,
    resume_point,
    verify_checkpoint,
    write_latest,
)
from omni_core.checkpoint.compat import check_resume_config
from omni_core.config import load_config, to_yaml
from omni_core.export import export_checkpoint
from omni_core.validation.paths import checkpoint_folder_problems, resume_problems

pytestmark = pytest.mark.xdist_group("mid_epoch_reference")  # shares that session run with other modules (conftest)

REPO = Path(__file__).resolve().parents[1]
SMALL = ["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2"]


def _small_save(root: Path, step: int, run_id: str, nbytes: int = 1024) -> Path:
    """A complete checkpoint of `run_id` (controller state as a run writes it, a tensor of `nbytes`)."""
    with CheckpointWriter(root, step) as w:
        w.write_tensors("actor/model", {"w": torch.full((nbytes // 4,), float(step))})
        w.write_torch_state("actor/optimizer", {"state": {}, "param_groups": []})
        w.write_state("controller", {"global_step": step, "run_id": run_id})
        return w.commit()


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("global_step_"))


# ------------------------------------------------------------------------------------- the actor's checkpoints
def _config(tiny_sd3_dir, root: Path, *extra: str):
    return load_config(
        overrides=[*SMALL, f"actor_rollout_ref.model.path={tiny_sd3_dir}", f"trainer.default_local_dir={root}", *extra]
    )


@pytest.fixture(scope="module")
def actor_run(tiny_sd3_dir, tmp_path_factory):
    """Two real checkpoints (steps 1 and 2) of the tiny model, written by `TrainingActor.save` through the
    `CheckpointWriter` as `_save_checkpoint` does (with the run's config.yaml), after one optimizer step."""
    from omni_core.workers.training_actor import TrainingActor

    root = tmp_path_factory.mktemp("actor_run")
    cfg = _config(tiny_sd3_dir, root)
    actor = TrainingActor(cfg.model_dump(mode="json"), total_training_steps=4, num_threads=1)
    params = list(actor.policy.trainable_parameters())
    sum(p.float().square().sum() for p in params).backward()  # a real optimizer step: Adam state exists
    actor.optimizer.step()
    actor.lr_scheduler.step()
    actor.optimizer.zero_grad()
    for step in (1, 2):
        actor.version = step
        with CheckpointWriter(root, step) as w:
            actor.save(str(w.tmp))
            w.write_state("controller", {"global_step": step, "run_id": "run-a"})
            w.write_config(to_yaml(cfg))
            w.commit()
    return root, cfg, actor


def _copy(root: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(root, dst)
    return dst


# ------------------------------------------------------------------ 1. a fresh run in a used folder
def test_fresh_run_in_a_used_folder_is_refused_and_never_overwrites(tmp_path, tiny_sd3_dir):
    root = tmp_path / "ckpt"
    old = {s: _small_save(root, s, "old-run") for s in (4, 8, 12)}
    cfg = _config(tiny_sd3_dir, root, "trainer.resume_mode=disable")
    (problem,) = checkpoint_folder_problems(cfg)
    assert problem.key == "trainer.resume_mode"
    for text in ("global_step_4, global_step_8, global_step_12", f"trainer.default_local_dir={root}", "experiment_name"):
        assert text in problem.message
    assert "new_experiment_per_run" in problem.message and "trainer.resume_mode=auto" in problem.message
    assert checkpoint_folder_problems(_config(tiny_sd3_dir, tmp_path / "new-folder", "trainer.resume_mode=disable")) == []

    # Past the refusal (a library user, or a race): the writer itself never replaces another run's checkpoint,
    with pytest.raises(CheckpointError, match="global_step_4 already holds a checkpoint of run 'old-run'.*experiment_name"):
        _small_save(root, 4, "new-run")
    verify_checkpoint(old[4])
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp_")]
    # never moves `latest` backwards,
    _small_save(root, 2, "new-run")
    _small_save(root, 3, "new-run")
    assert read_latest_step(root) == 12
    # and retention deletes only the new run's own checkpoints (older runs' newer ones are not its to delete).
    deleted = apply_retention(root, max_keep=1, run_id="new-run")
    assert [p.name for p in deleted] == ["global_step_2"]
    assert _steps(root) == ["global_step_12", "global_step_3", "global_step_4", "global_step_8"]
    for path in old.values():
        verify_checkpoint(path)


def test_a_retry_replaces_its_own_uncommitted_copy_and_resume_path_below_newer_is_refused(tmp_path, tiny_sd3_dir):
    root = tmp_path / "ckpt"
    _small_save(root, 1, "run-a")
    _small_save(root, 2, "run-a")
    write_latest(root, 1)  # what a kill between step 2's rename and its `latest` write leaves (see test below)
    replaced = _small_save(root, 2, "run-a", nbytes=2048)  # the retried epoch recomputes step 2
    assert read_latest_step(root) == 2 and (replaced / "actor" / "model.safetensors").stat().st_size > 2048
    cfg = _config(tiny_sd3_dir, root, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={root / 'global_step_1'}")
    (problem,) = checkpoint_folder_problems(cfg)
    assert problem.key == "trainer.resume_from_path" and "newer than the resume point (global_step_2)" in problem.message


# ------------------------------------------------------------------ 2. export next to the model / checkpoint
def test_export_refuses_targets_that_hold_the_model_or_checkpoint(tmp_path, tiny_sd3_dir):
    work = tmp_path / "work"
    base = work / "model"
    shutil.copytree(tiny_sd3_dir, base)
    ckpt = work / "runs" / "global_step_1"
    (ckpt / "actor" / "hf").mkdir(parents=True)
    (ckpt / "actor" / "hf" / "weights.bin").write_bytes(b"trained")
    (work / "export_info.json").write_text("{}")  # looks like an earlier export: the old code deleted `work`
    (tmp_path / "link").symlink_to(work)
    for target, what in (
        (work, "contains the base model folder"),
        (tmp_path / "link", "contains the base model folder"),
        (work / "runs", "contains the checkpoint folder"),
        (ckpt, "is the checkpoint folder"),
        (base / "transformer", "is inside the base model folder"),
    ):
        with pytest.raises(ValueError, match=f"export_dir=.* {what} .*base model \\({base}\\) and the checkpoint \\({ckpt}\\)"):
            export_checkpoint(base, ckpt, target)
    assert (ckpt / "actor" / "hf" / "weights.bin").read_bytes() == b"trained"
    assert (base / "model_index.json").is_file() and (base / "transformer").is_dir()


# ------------------------------------------------------------------ 3. a truncated / corrupted file
def test_truncated_latest_checkpoint_falls_back_to_the_newest_that_verifies(actor_run, tmp_path, tiny_sd3_dir):
    root = _copy(actor_run[0], tmp_path)
    model = root / "global_step_2" / "actor" / "model.safetensors"
    half = model.stat().st_size // 2
    with open(model, "r+b") as f:  # half of the file cut off, as a full disk or a killed copy leaves it
        f.truncate(half)
    cfg = _config(tiny_sd3_dir, root)
    assert resume_problems(cfg) == []  # before Ray: a fallback exists

    # Same size, other bytes: only the sha256 (what the run computes once at start) sees it.
    first = root / "global_step_1" / "actor" / "optimizer.pt"
    data = bytearray(first.read_bytes())
    data[-20] ^= 0xFF
    first.write_bytes(bytes(data))
    verify_checkpoint(root / "global_step_1", hashes=False)
    with pytest.raises(CheckpointError) as err:
        resume_point(root, "auto")
    assert f"{model} has " in str(err.value) and f"{first} has a different sha256" in str(err.value)
    assert "move the damaged global_step_N folders" in str(err.value)
    assert _steps(root) == ["global_step_1", "global_step_2"]  # nothing to resume: nothing is moved

    # Nothing verifies even by size: refused by the check that runs before Ray, naming the file.
    with open(first, "r+b") as f:
        f.truncate(10)
    (problem,) = resume_problems(cfg)
    assert problem.key == "trainer.resume_mode" and str(first) in problem.message and "safetensors" in problem.message

    # Step 1 intact, step 2 truncated: the run resumes from step 1 and moves step 2 aside (kept, out of the way of the
    # step 2 it is about to save: the writer never replaces another run's complete checkpoint).
    root = tmp_path / "second"
    shutil.copytree(actor_run[0], root)
    model = root / "global_step_2" / "actor" / "model.safetensors"
    with open(model, "r+b") as f:
        f.truncate(half)
    lines: list[str] = []
    assert resume_point(root, "auto", log_fn=lines.append) == root / "global_step_1"
    assert f"skipping checkpoint {root / 'global_step_2'}" in lines[0] and f"{model} has " in lines[0] and "truncated" in lines[0]
    assert lines[1] == f"resuming from {root / 'global_step_1'}, the newest checkpoint that matches its manifest"
    aside = root / "global_step_2.damaged"
    assert lines[2].startswith(f"moved {root / 'global_step_2'} aside to {aside}: the run resumes from {root / 'global_step_1'}")
    assert _steps(root) == ["global_step_1", "global_step_2.damaged"] and read_latest_step(root) == 1
    assert (aside / "actor" / "model.safetensors").stat().st_size == half and (aside / "manifest.json").is_file()
    assert _small_save(root, 2, "run-b") == root / "global_step_2" and read_latest_step(root) == 2
    # Damaged again: the next start moves it beside the first.
    (root / "global_step_2" / "actor" / "model.safetensors").write_bytes(b"")
    assert resume_point(root, "auto") == root / "global_step_1"
    assert _steps(root) == ["global_step_1", "global_step_2.damaged", "global_step_2.damaged-2"]


# ------------------------------------------------------------------ 4. a writer killed mid-write
_WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[2])
    import torch
    from omni_core.checkpoint import CheckpointWriter
    with CheckpointWriter(sys.argv[1], 2) as w:
        for shard in range(64):  # 64 x 32 MB, then hashing it all for the manifest: seconds of writing
            w.write_tensors(f"actor/model-{shard:02d}", {"w": torch.full((8 << 20,), float(shard))})
        w.write_state("controller", {"global_step": 2, "run_id": "killed"})
        w.commit()
""")


def test_writer_killed_mid_write_leaves_a_tmp_folder_the_next_start_removes(tmp_path):
    root = tmp_path / "ckpt"
    first = _small_save(root, 1, "killed")
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(root), str(REPO)])
    tmp = root / f".tmp_global_step_2_{writer.pid}"
    try:
        deadline = time.monotonic() + 120
        while not (tmp / "actor" / "model-00.safetensors").exists():  # mid-write: its first shard has appeared
            assert writer.poll() is None and time.monotonic() < deadline, "the writer ended before it was killed"
            time.sleep(0.01)
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait(timeout=30)
    assert writer.returncode == -signal.SIGKILL
    assert tmp.is_dir() and not (root / "global_step_2").exists() and read_latest_step(root) == 1

    # A leftover whose writer is alive (another process of the run) is kept; the dead writer's is removed.
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        busy = root / f".tmp_global_step_3_{live.pid}"
        busy.mkdir()
        assert resume_point(root, "auto") == first
        assert not tmp.exists() and busy.is_dir()
    finally:
        live.communicate(timeout=30)
    verify_checkpoint(first)


def test_a_complete_checkpoint_newer_than_latest_is_the_resume_point(tmp_path):
    # The state a kill between `commit`'s rename and its `latest` write leaves (a window of microseconds that
    # no real kill hits reliably, so it is constructed): global_step_2 complete, `latest` still 1.
    root = tmp_path / "ckpt"
    _small_save(root, 1, "run-a")
    second = _small_save(root, 2, "run-a")
    write_latest(root, 1)
    assert find_latest(root) == second and resume_point(root, "auto") == second


# ------------------------------------------------------------------ 5. disk full
@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4M", "tmpfs", str(disk)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        # CI runs as root on Debian, where mounting works: a failure here is a broken environment, never a pass.
        pytest.fail(f"cannot mount a tmpfs for the disk-full test ({exc}); run the tests as root")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_disk_full_is_a_clear_error_and_the_previous_checkpoint_survives(small_disk, tiny_sd3_dir):
    root = small_disk / "ckpt"
    first = _small_save(root, 1, "run-a", nbytes=1 << 20)
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (shutil.disk_usage(small_disk).free - (512 << 10)))
    with pytest.raises(DiskFullError, match=rf"free space in {root} .* bytes free, about [\d,]+ bytes are needed"):
        _small_save(root, 2, "run-a", nbytes=1 << 20)  # refused before writing (the last checkpoint's size)
    filler.unlink()
    with pytest.raises(DiskFullError, match=rf"free space in {root} .*the write ran out of space.*intact"):
        _small_save(root, 2, "run-a", nbytes=6 << 20)  # passes the estimate, then ENOSPC mid-write
    assert not [p.name for p in root.iterdir() if p.name.startswith(".tmp_")]
    verify_checkpoint(first)
    assert read_latest_step(root) == 1 and resume_point(root, "auto") == first
    assert _small_save(root, 2, "run-a") == root / "global_step_2"  # space freed: the run goes on

    # The training actor checks its own state-dict size (~9 MB of weights, twice, plus Adam's state).
    from omni_core.workers.training_actor import TrainingActor

    actor = TrainingActor(_config(tiny_sd3_dir, root).model_dump(mode="json"), total_training_steps=4, num_threads=1)
    with CheckpointWriter(root, 3, needed_bytes=0) as w, pytest.raises(DiskFullError, match=f"free space in {w.tmp}"):
        actor.save(str(w.tmp))
    assert _steps(root) == ["global_step_1", "global_step_2"]


# ------------------------------------------------------------------ 14. resume with a changed config
def test_changed_model_keys_are_refused_and_optimizer_keys_applied(actor_run, tiny_sd3_dir, caplog):
    root, cfg, _ = actor_run
    changed = _config(tiny_sd3_dir, root, "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8")
    (problem,) = resume_problems(changed)
    assert problem.key == "actor_rollout_ref.model.lora_rank" and "saved with 0" in problem.message
    assert "set actor_rollout_ref.model.lora_rank=0 to resume it, or start a new experiment" in problem.message
    with pytest.raises(CheckpointError, match=r"actor_rollout_ref.model.lora_rank: checkpoint 0, now 4"):
        check_resume_config(root / "global_step_2", changed.model_dump(mode="json"))
    # A new world size resumes (whole-state checkpoint), with a line saying so; a sharded strategy does not.
    ws = _config(tiny_sd3_dir, root, "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.strategy=ddp")
    assert resume_problems(ws) == []
    (line,) = check_resume_config(root / "global_step_2", ws.model_dump(mode="json"))
    assert line.startswith("trainer.n_gpus_per_node x trainer.nnodes changed") and "'1 x 1' -> '2 x 1'" in line
    sharded = _config(tiny_sd3_dir, root, "actor_rollout_ref.actor.strategy=fsdp2")
    assert [p.key for p in resume_problems(sharded)] == ["actor_rollout_ref.actor.strategy"]

    from omni_core.workers.training_actor import TrainingActor

    new_lr = _config(
        tiny_sd3_dir, root, "actor_rollout_ref.actor.optim.lr=0.5", "actor_rollout_ref.actor.optim.weight_decay=0.25"
    )
    assert resume_problems(new_lr) == []
    (line, wd) = check_resume_config(root / "global_step_2", new_lr.model_dump(mode="json"))
    assert line.startswith(
        f"actor_rollout_ref.actor.optim.lr changed since {root / 'global_step_2'}: {cfg.actor_rollout_ref.actor.optim.lr!r} -> 0.5"
    )
    assert wd.startswith("actor_rollout_ref.actor.optim.weight_decay changed")
    actor = TrainingActor(new_lr.model_dump(mode="json"), total_training_steps=4, num_threads=1)
    assert actor.reset(str(root / "global_step_2")) == 2
    multiplier = actor.lr_scheduler.lr_lambdas[0](actor.lr_scheduler.last_epoch)
    group = actor.optimizer.param_groups[0]
    assert group["lr"] == 0.5 * multiplier and group["weight_decay"] == 0.25 and actor.lr_scheduler.base_lrs == [0.5]
    saved = torch.load(root / "global_step_2" / "actor" / "optimizer.pt", weights_only=True)
    assert saved["param_groups"][0]["lr"] != group["lr"]  # the checkpoint's value no longer wins
    assert set(actor.optimizer.state_dict()["state"]) == set(saved["state"])  # Adam's moments were loaded


def test_a_checkpoint_without_the_optimizer_is_export_only(actor_run, tiny_sd3_dir, tmp_path):
    from omni_core.workers.training_actor import TrainingActor

    root = tmp_path / "ckpt"
    cfg = _config(tiny_sd3_dir, root, "actor_rollout_ref.actor.checkpoint.save_contents=[model]")
    actor = TrainingActor(cfg.model_dump(mode="json"), total_training_steps=4, num_threads=1)
    with CheckpointWriter(root, 1) as w:
        actor.save(str(w.tmp))
        w.write_state("controller", {"global_step": 1, "run_id": "run-a"})
        w.write_config(to_yaml(cfg))
        path = w.commit()
    (problem,) = resume_problems(cfg)
    assert "saved without the optimizer" in problem.message and "export-only" in problem.message
    with pytest.raises(CheckpointError, match="export-only"):
        actor.reset(str(path))
    manifest = json.loads((path / "manifest.json").read_text())
    assert "actor/hf/config.json" in {e["path"] for e in manifest["files"]}  # still exportable


# ------------------------------------------------------------------ 3 + 4, through the flow
@pytest.fixture(scope="module")
def mid_epoch_reference(flow_overrides, prefect_api, ray_cluster, transfer_queue, tmp_path_factory) -> Path:
    from flow_utils import run_mid_epoch_reference

    return run_mid_epoch_reference(flow_overrides, tmp_path_factory)


def _dead_pid() -> int:
    """The pid of a process that has exited (a writer SIGKILLed mid-save leaves its pid in its temp folder's name)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


@pytest.mark.timeout(900)
def test_the_same_command_on_a_damaged_folder_resumes_the_newest_good_checkpoint(flow_overrides, mid_epoch_reference, tmp_path):
    """A finished run's folder (steps 2, 3 and 4 kept), damaged three ways: the latest checkpoint's weights cut short,
    one byte of step 3's weights flipped (same size: only the sha256 sees it) and a dead writer's `.tmp_` folder. The
    same command skips 4 and 3 (moved aside, out of the way of the steps it saves again), removes the leftover, resumes
    from step 2, trains steps 3 and 4 again and ends with the uninterrupted run's weights, bit for bit (resuming the
    flipped step 3 would not)."""
    from flow_utils import MID_EPOCH, assert_same_weights, final_weights
    from omniflow.flows.main_diffusion_v1 import main_diffusion_v1

    from omni_core.tracking import read_jsonl

    root = _copy(mid_epoch_reference, tmp_path)
    assert _steps(root) == ["global_step_2", "global_step_3", "global_step_4"] and read_latest_step(root) == 4
    truncated = root / "global_step_4" / "actor" / "model.safetensors"
    with open(truncated, "r+b") as f:
        f.truncate(truncated.stat().st_size - 4096)
    flipped = root / "global_step_3" / "actor" / "model.safetensors"
    data = bytearray(flipped.read_bytes())
    data[-4] ^= 0x01  # the lowest mantissa bit of the last float32: a weight off by one ulp, the file the same size
    flipped.write_bytes(bytes(data))
    verify_checkpoint(root / "global_step_3", hashes=False)  # sizes alone pass it
    leftover = root / f".tmp_global_step_4_{_dead_pid()}"
    (leftover / "actor").mkdir(parents=True)
    shutil.copy(root / "global_step_4" / "actor" / "optimizer.pt", leftover / "actor")  # a save cut off mid-write

    state = main_diffusion_v1(overrides=[*flow_overrides, *MID_EPOCH, f"trainer.default_local_dir={root}"], return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    steps = [r["step"] for r in read_jsonl(Path(result.log_dir) / "metrics.jsonl") if "critic/rewards/mean" in r]
    assert steps == [3, 4]  # resumed from step 2: steps 3 and 4 trained again, nothing else
    assert not leftover.exists()
    assert _steps(root) == ["global_step_2", "global_step_3", "global_step_3.damaged", "global_step_4", "global_step_4.damaged"]
    assert read_latest_step(root) == 4
    for step in (2, 3, 4):
        verify_checkpoint(root / f"global_step_{step}")
    assert_same_weights(final_weights(root), final_weights(mid_epoch_reference))
