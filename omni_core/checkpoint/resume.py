"""Which checkpoint to resume from, which to delete, and clearing what crashed runs left behind.

`find_latest` trusts `latest_checkpointed_iteration.txt` when it names a complete checkpoint, and
otherwise scans for complete `global_step_N` folders (those with a manifest); `.tmp_*` folders are never
candidates. Retention never deletes the latest checkpoint nor a protected one (the checkpoint a running
`fit_epoch` would restart from, DESIGN.md section 2).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from omni_core.checkpoint.layout import (
    TMP_PREFIX,
    CheckpointError,
    complete_steps,
    is_complete,
    read_latest_step,
    step_dir,
)

log = logging.getLogger(__name__)

RESUME_MODES = ("auto", "disable", "resume_path")


def find_latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None when there is none."""
    root = Path(root)
    latest = read_latest_step(root)
    if latest is not None:
        path = step_dir(root, latest)
        if is_complete(path):
            return path
        log.warning(
            "%s names step %s, which is not a complete checkpoint; scanning %s instead",
            root / "latest_checkpointed_iteration.txt",
            latest,
            root,
        )
    steps = complete_steps(root)
    return steps[max(steps)] if steps else None


def resolve_resume(root: str | Path, resume_mode: str, resume_from_path: str | Path | None = None) -> Path | None:
    """The checkpoint to resume from for `trainer.resume_mode` (None: start fresh)."""
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        return find_latest(root)
    if resume_mode != "resume_path":
        raise ValueError(f"trainer.resume_mode={resume_mode!r} is not one of {', '.join(RESUME_MODES)}")
    if not resume_from_path:
        raise CheckpointError("trainer.resume_mode=resume_path needs trainer.resume_from_path=<.../global_step_N>")
    path = Path(resume_from_path).expanduser()
    if not path.exists():
        raise CheckpointError(f"trainer.resume_from_path={resume_from_path} does not exist")
    if not is_complete(path):
        hint = (
            f"; to resume the newest checkpoint in it, use trainer.resume_mode=auto trainer.default_local_dir={path}"
            if complete_steps(path)
            else ""
        )
        raise CheckpointError(
            f"trainer.resume_from_path={resume_from_path} is not a checkpoint "
            f"(expected a complete global_step_N folder with manifest.json){hint}"
        )
    return path


def cleanup_partial(root: str | Path) -> list[Path]:
    """Remove `.tmp_*` leftovers of crashed saves; call while holding the RunLock (no writer is active)."""
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    for path in sorted(root.iterdir()):
        if not path.name.startswith(TMP_PREFIX):
            continue
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append(path)
    if removed:
        log.info("removed %d partial checkpoint leftovers under %s", len(removed), root)
    return removed


def apply_retention(root: str | Path, max_keep: int | None, protect: set[int] | frozenset[int] = frozenset()) -> list[Path]:
    """Delete the oldest complete checkpoints beyond `max_keep` (None: keep all), except protected and latest.

    Protected and latest checkpoints survive even if that keeps more than `max_keep`; returns what was deleted.
    """
    if max_keep is None:
        return []
    if max_keep < 1:
        raise ValueError(f"trainer.max_actor_ckpt_to_keep={max_keep} must be >= 1 or null (keep all)")
    root = Path(root)
    steps = complete_steps(root)
    keep = set(sorted(steps)[-max_keep:]) | set(protect)
    latest = read_latest_step(root)
    if latest is not None:
        keep.add(latest)
    deleted = []
    for step in sorted(steps):
        if step in keep:
            continue
        path = steps[step]
        # Rename first: a crash mid-delete then leaves a .tmp_ folder, never a global_step_N that still has
        # its manifest but lost some files.
        doomed = root / f"{TMP_PREFIX}delete_{path.name}_{os.getpid()}"
        os.rename(path, doomed)
        shutil.rmtree(doomed)
        deleted.append(path)
    return deleted
