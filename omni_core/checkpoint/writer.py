"""Writing a checkpoint atomically: begin (a temp folder) -> files -> commit (manifest, fsync, rename, latest).

A checkpoint becomes visible only by renaming a complete, fsynced folder to `global_step_N`, and
`latest_checkpointed_iteration.txt` is rewritten (tmp file + os.replace) only after that, so a crash at
any point leaves `latest` naming the previous complete checkpoint (verl writes into the final folder
directly; a crash there leaves a half checkpoint that `auto` resume would pick up).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from omni_core.checkpoint import files
from omni_core.checkpoint.layout import (
    LATEST_FILE,
    MANIFEST_FILE,
    TMP_PREFIX,
    CheckpointError,
    read_latest_step,
    step_dir,
    tmp_dir,
)

MANIFEST_FORMAT = "omniflow-checkpoint/1"


def begin(root: str | Path, step: int) -> Path:
    """A fresh temp folder inside `root` (same filesystem, so the final rename is atomic)."""
    if int(step) < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    tmp = tmp_dir(root, step)
    if tmp.exists():  # a save of the same step in this process that never committed
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(root: str | Path, tmp: str | Path, step: int) -> Path:
    """Seal `tmp` as `<root>/global_step_<step>` and point `latest` at it; returns the final folder."""
    root, tmp = Path(root), Path(tmp)
    if not tmp.is_dir() or tmp.parent.resolve() != root.resolve():
        raise CheckpointError(f"{tmp}: not a checkpoint temp folder inside {root}; create it with begin(root, step)")
    final = step_dir(root, step)
    write_manifest(tmp, step)
    _fsync_tree(tmp)
    if final.exists():
        # Left by an attempt that renamed but crashed before updating `latest` (so `latest` is older and
        # nothing resumes from it); a retry recomputes the same step, and the new copy replaces it.
        if read_latest_step(root) == step:
            raise CheckpointError(f"{final} is the latest checkpoint and already exists; refusing to overwrite it")
        aside = root / f"{TMP_PREFIX}replaced_{final.name}_{os.getpid()}"
        os.rename(final, aside)
        shutil.rmtree(aside)
    os.rename(tmp, final)
    _fsync_dir(root)
    write_latest(root, step)
    return final


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
    return json.loads(path.read_text())


def verify_checkpoint(ckpt: str | Path) -> None:
    """Recompute every file's size and sha256 against the manifest; raises naming what differs."""
    ckpt = Path(ckpt)
    problems = []
    for entry in read_manifest(ckpt)["files"]:
        path = ckpt / entry["path"]
        if not path.is_file():
            problems.append(f"{entry['path']} missing")
        elif path.stat().st_size != entry["size"] or _sha256(path) != entry["sha256"]:
            problems.append(f"{entry['path']} changed")
    if problems:
        raise CheckpointError(f"{ckpt}: does not match its manifest ({', '.join(problems)}); resume from an older checkpoint")


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

    def __init__(self, root: str | Path, step: int):
        self.root, self.step = Path(root), int(step)
        self.tmp = begin(self.root, self.step)
        self.path: Path | None = None  # the final folder, once committed

    @property
    def actor_dir(self) -> Path:
        return files.actor_dir(self.tmp)

    def write_state(self, name: str, obj: Any) -> Path:
        return files.write_state(self.tmp, name, obj)

    def write_tensors(self, name: str, tensors: dict[str, Any]) -> Path:
        return files.write_tensors(self.tmp, name, tensors)

    def write_torch_state(self, name: str, state: dict[str, Any]) -> Path:
        return files.write_torch_state(self.tmp, name, state)

    def write_config(self, yaml_text: str) -> Path:
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
