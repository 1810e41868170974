"""Writing a checkpoint atomically: begin (a temp folder) -> files -> commit (manifest, fsync, rename, latest).

A checkpoint becomes visible only by renaming a complete, fsynced folder to `global_step_N`, and
`latest_checkpointed_iteration.txt` is rewritten (tmp file + os.replace) only after that, so a crash at
any point leaves `latest` naming the previous complete checkpoint (verl writes into the final folder
directly; a crash there leaves a half checkpoint that `auto` resume would pick up).

Nothing saved is lost: `commit` never replaces a complete checkpoint of another run (the `run_id` in its
`controller.json`) and never moves `latest` backwards. A full disk is found before writing when possible
(free space against the last checkpoint's size) and otherwise when a write fails with ENOSPC: either way
the temp folder is removed and `DiskFullError` names the folder, the free and the needed bytes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from omni_core.checkpoint import files
from omni_core.checkpoint.layout import (
    LATEST_FILE,
    MANIFEST_FILE,
    TMP_PREFIX,
    CheckpointError,
    complete_steps,
    is_complete,
    read_latest_step,
    step_dir,
    tmp_dir,
)

log = logging.getLogger(__name__)

MANIFEST_FORMAT = "omniflow-checkpoint/1"
CONTROLLER_STATE = "controller"  # <ckpt>/controller.json: global_step and the run_id that wrote it
# Free space asked beyond the estimate: metadata, the manifest, and a checkpoint a little larger than the last.
SPACE_MARGIN = 1.1


class DiskFullError(CheckpointError):
    """Not enough free space for a checkpoint; the message names the folder, the free and the needed bytes."""

    errno = errno.ENOSPC


def _free_bytes(folder: str | Path) -> int:
    """Free bytes on the filesystem of `folder`, or of its nearest existing parent (not created yet)."""
    path = Path(folder).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def disk_full_error(folder: str | Path, needed: int | None) -> DiskFullError:
    free = _free_bytes(folder)
    need = f"about {needed:,} bytes are needed" if needed else "the write ran out of space"
    return DiskFullError(
        f"not enough free space in {folder} for a checkpoint: {free:,} bytes free, {need}. The previous checkpoint "
        f"is intact. Free space there (or lower trainer.max_actor_ckpt_to_keep, or point trainer.default_local_dir "
        f"at a larger disk), then run the same command again to resume",
    )


def check_free_space(folder: str | Path, needed: int) -> None:
    """Raise `DiskFullError` unless `folder`'s filesystem has `needed` bytes (times a margin) free."""
    if needed > 0 and _free_bytes(folder) < needed * SPACE_MARGIN:
        raise disk_full_error(folder, int(needed * SPACE_MARGIN))


@contextmanager
def disk_full_guard(folder: str | Path, cleanup: Path | None = None, needed: int | None = None) -> Iterator[None]:
    """Turn ENOSPC inside the block into `DiskFullError` (removing `cleanup`, a partial temp folder, first)."""
    try:
        yield
    except Exception as exc:  # safetensors raises a plain SafetensorError, torch.save a RuntimeError
        if not _out_of_space(exc, folder):
            raise
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)
        raise disk_full_error(folder, needed) from exc


def _out_of_space(exc: BaseException, folder: str | Path) -> bool:
    """ENOSPC, said as an errno or in the text of a library's own error; torch.save only says "file write
    failed", so a write error on a filesystem left with under 1 MiB free counts too."""
    if getattr(exc, "errno", None) == errno.ENOSPC or "os error 28" in str(exc) or "No space left" in str(exc):
        return True
    try:
        return _free_bytes(folder) < (1 << 20)
    except OSError:
        return False


def last_checkpoint_bytes(root: str | Path) -> int:
    """The size of the newest complete checkpoint under `root` (from its manifest), 0 when there is none."""
    steps = complete_steps(root)
    if not steps:
        return 0
    try:
        return int(read_manifest(steps[max(steps)])["total_bytes"])
    except (CheckpointError, KeyError, TypeError, ValueError):
        return 0


def run_id_of(ckpt: str | Path) -> str | None:
    """The run that wrote `ckpt` (its controller.json `run_id`), or None when not recorded or unreadable."""
    try:
        state = json.loads((Path(ckpt) / f"{CONTROLLER_STATE}.json").read_text())
    except (OSError, ValueError):
        return None
    return state.get("run_id") if isinstance(state, dict) else None


def begin(root: str | Path, step: int, needed_bytes: int | None = None) -> Path:
    """A fresh temp folder inside `root` (same filesystem, so the final rename is atomic).

    Refuses (`DiskFullError`) when the filesystem lacks `needed_bytes`, by default the size of the last
    checkpoint under `root` (a new checkpoint is written before retention deletes an old one).
    """
    if int(step) < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    Path(root).mkdir(parents=True, exist_ok=True)
    check_free_space(root, last_checkpoint_bytes(root) if needed_bytes is None else needed_bytes)
    tmp = tmp_dir(root, step)
    if tmp.exists():  # a save of the same step in this process that never committed
        shutil.rmtree(tmp)
    with disk_full_guard(root, cleanup=tmp):
        tmp.mkdir(parents=True)
    return tmp


def commit(root: str | Path, tmp: str | Path, step: int) -> Path:
    """Seal `tmp` as `<root>/global_step_<step>` and point `latest` at it; returns the final folder."""
    root, tmp = Path(root), Path(tmp)
    if not tmp.is_dir() or tmp.parent.resolve() != root.resolve():
        raise CheckpointError(f"{tmp}: not a checkpoint temp folder inside {root}; create it with begin(root, step)")
    final = step_dir(root, step)
    with disk_full_guard(root, cleanup=tmp):
        write_manifest(tmp, step)
        _fsync_tree(tmp)
    if final.exists():
        _check_replaceable(root, tmp, final, step)
        aside = root / f"{TMP_PREFIX}replaced_{final.name}_{os.getpid()}"
        os.rename(final, aside)
        shutil.rmtree(aside)
    os.rename(tmp, final)
    _fsync_dir(root)
    latest = read_latest_step(root)
    if latest is not None and latest > step and is_complete(step_dir(root, latest)):
        # Only a run that branched below another run's newer checkpoints gets here (validation refuses to
        # start one); `latest` keeps naming the newest checkpoint rather than moving backwards.
        log.warning("%s stays at step %d (newer than the step %d just saved)", root / LATEST_FILE, latest, step)
    else:
        with disk_full_guard(root):
            write_latest(root, step)
    return final


def _check_replaceable(root: Path, tmp: Path, final: Path, step: int) -> None:
    """Refuse to replace `final` unless it is a leftover of this same run that nothing resumes from yet.

    A retry that recomputes a step whose first attempt renamed but crashed before updating `latest` replaces
    its own copy; a complete checkpoint of another run (or of unknown origin) is never replaced.
    """
    if read_latest_step(root) == step and is_complete(final):
        raise CheckpointError(f"{final} is the latest checkpoint and already exists; refusing to overwrite it")
    if not is_complete(final):
        return  # no manifest: never a loadable checkpoint (e.g. an empty folder made by hand)
    ours, theirs = run_id_of(tmp), run_id_of(final)
    if ours is None or ours != theirs:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"{final} already holds a checkpoint of run {theirs!r}; refusing to replace it with step {step} of run "
            f"{ours!r}. Give the new run its own folder (a new trainer.experiment_name, or new_experiment_per_run=true) "
            f"or continue that run with trainer.resume_mode=auto"
        )


def write_latest(root: str | Path, step: int) -> None:
    """Atomically rewrite latest_checkpointed_iteration.txt (readers see the old or the new step, never half)."""
    root = Path(root)
    tmp = root / f"{TMP_PREFIX}latest_{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(int(step)))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST_FILE)
    _fsync_dir(root)


# ------------------------------------------------------------------------------------------ manifest
def write_manifest(ckpt: str | Path, step: int) -> dict[str, Any]:
    """`manifest.json`: every file's relative path, size and sha256, plus step and creation time."""
    ckpt = Path(ckpt)
    entries = [{"path": rel, "size": (ckpt / rel).stat().st_size, "sha256": _sha256(ckpt / rel)} for rel in _list_files(ckpt)]
    manifest = {
        "format": MANIFEST_FORMAT,
        "step": int(step),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "created_unix": time.time(),
        "total_bytes": sum(e["size"] for e in entries),
        "files": entries,
    }
    (ckpt / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_manifest(ckpt: str | Path) -> dict[str, Any]:
    path = Path(ckpt) / MANIFEST_FILE
    if not path.is_file():
        raise CheckpointError(f"{ckpt}: no {MANIFEST_FILE}; not a complete OmniFlow checkpoint")
    try:
        manifest = json.loads(path.read_text())
        manifest["files"]  # noqa: B018  (a manifest without its file list is as unreadable as broken JSON)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: unreadable manifest ({exc}); the checkpoint cannot be verified") from exc
    return manifest


def verify_checkpoint(ckpt: str | Path, hashes: bool = True) -> None:
    """Check every file of the manifest: present, its size, and (with `hashes`) its sha256; raises naming each
    file that differs and how. Hashing reads every byte (about 1 GB/s per core); sizes alone cost one stat
    per file and already catch truncated and missing files."""
    ckpt = Path(ckpt)
    problems = []
    for entry in read_manifest(ckpt)["files"]:
        path = ckpt / entry["path"]
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif (size := path.stat().st_size) != entry["size"]:
            problems.append(f"{path} has {size} bytes, the manifest {entry['size']} (truncated or rewritten)")
        elif hashes and _sha256(path) != entry["sha256"]:
            problems.append(f"{path} has a different sha256 than the manifest (corrupted)")
    if problems:
        raise CheckpointError(f"{ckpt}: does not match its manifest: {'; '.join(problems)}")


def checkpoint_summary(ckpt: str | Path) -> dict[str, Any]:
    """What a run publishes about a checkpoint: path, step, size, and the manifest's sha256.

    The manifest holds each file's hash, so its own hash fingerprints the whole checkpoint.
    """
    ckpt = Path(ckpt)
    manifest = read_manifest(ckpt)
    return {
        "path": str(ckpt),
        "step": manifest["step"],
        "size_bytes": manifest["total_bytes"],
        "num_files": len(manifest["files"]),
        "sha256": _sha256(ckpt / MANIFEST_FILE),
        "created": manifest["created"],
    }


# ------------------------------------------------------------------------------------------- writer
class CheckpointWriter:
    """`begin` + the file writers + `commit` for one step; leaving a `with` block uncommitted aborts it."""

    def __init__(self, root: str | Path, step: int, needed_bytes: int | None = None):
        self.root, self.step = Path(root), int(step)
        self.tmp = begin(self.root, self.step, needed_bytes)
        self.path: Path | None = None  # the final folder, once committed

    @property
    def actor_dir(self) -> Path:
        with disk_full_guard(self.root, cleanup=self.tmp):
            return files.actor_dir(self.tmp)

    def write_state(self, name: str, obj: Any) -> Path:
        with disk_full_guard(self.root, cleanup=self.tmp):
            return files.write_state(self.tmp, name, obj)

    def write_tensors(self, name: str, tensors: dict[str, Any]) -> Path:
        with disk_full_guard(self.root, cleanup=self.tmp):
            return files.write_tensors(self.tmp, name, tensors)

    def write_torch_state(self, name: str, state: dict[str, Any]) -> Path:
        with disk_full_guard(self.root, cleanup=self.tmp):
            return files.write_torch_state(self.tmp, name, state)

    def write_config(self, yaml_text: str) -> Path:
        with disk_full_guard(self.root, cleanup=self.tmp):
            return files.write_config(self.tmp, yaml_text)

    def commit(self) -> Path:
        self.path = commit(self.root, self.tmp, self.step)
        return self.path

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.path is None:
            self.abort()


# ------------------------------------------------------------------------------------------ helpers
def _list_files(ckpt: Path) -> list[str]:
    return sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_tree(ckpt: Path) -> None:
    # Files may come from another process (the training actor); fsync through our own descriptor still
    # flushes them, since the data belongs to the inode, not to the writer's descriptor.
    for path in ckpt.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for d in [ckpt, *(p for p in ckpt.rglob("*") if p.is_dir())]:
        _fsync_dir(d)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
