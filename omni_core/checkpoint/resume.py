"""Which checkpoint to resume from, which to delete, and clearing what crashed runs left behind.

`find_latest` returns the newest complete `global_step_N` folder (one with a manifest); `.tmp_*` folders
are never candidates. It is newer than `latest_checkpointed_iteration.txt` when a run died between the
final rename and the `latest` write: the checkpoint is complete (fsynced before the rename), so it wins.
`resume_point` is what a run does first with its folder: remove dead writers' `.tmp_*` leftovers, then
choose the resume point, skipping checkpoints that no longer match their manifest, and move those skipped ones
aside (`global_step_N.damaged`): the run is about to write those steps again, and the writer never replaces a
complete checkpoint of another run, so left in place they would stop it at its next save. Retention never deletes
the latest checkpoint, a protected one (the checkpoint a running `fit_epoch` would restart from, docs/design.md
section 2), nor another run's checkpoint newer than the current run's oldest.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

from omni_core.checkpoint.layout import (
    LATEST_FILE,
    LOCK_FILE,
    TMP_PREFIX,
    CheckpointError,
    complete_steps,
    is_complete,
    read_latest_step,
    step_of,
)
from omni_core.checkpoint.lock import pid_alive, read_lock
from omni_core.checkpoint.writer import run_id_of, verify_checkpoint, write_latest

log = logging.getLogger(__name__)

RESUME_MODES = ("auto", "disable", "resume_path")


def find_latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None when there is none."""
    root = Path(root)
    steps = complete_steps(root)
    if not steps:
        return None
    newest, latest = max(steps), read_latest_step(root)
    if latest != newest:
        # latest is behind after a kill between the rename and its rewrite; ahead when it names a folder that
        # is gone or incomplete. Either way the newest complete checkpoint is the run's real progress.
        log.warning("%s names step %s; the newest complete checkpoint is %s", root / LATEST_FILE, latest, steps[newest])
    return steps[newest]


def resume_point(
    root: str | Path,
    resume_mode: str,
    resume_from_path: str | Path | None = None,
    hashes: bool = True,
    log_fn: Callable[[str], None] | None = None,
) -> Path | None:
    """What a run does first with its checkpoint folder, holding its RunLock: remove dead writers' `.tmp_*`
    leftovers, then return the verified resume point for `trainer.resume_mode` (None: start fresh).

    `auto` takes the newest checkpoint that matches its manifest, skipping (and reporting through `log_fn`)
    newer ones that do not; when none matches, or `resume_path` names one that does not, it raises a
    `CheckpointError` naming each damaged file. With `hashes` every byte is hashed (sha256, about 1 GB/s per
    core: seconds for a LoRA checkpoint, ~20-30 s for a full fine-tune of a 2B model with its Adam state); a
    run pays it once when it starts, never per epoch. `hashes=False` checks sizes only (one stat per file),
    which is what `omniflow validate` does. The skipped (damaged) checkpoints are moved aside, kept for
    inspection (`set_aside_newer`), and `latest` names the resume point.
    """
    cleanup_partial(root)
    path = choose_resume(root, resume_mode, resume_from_path, hashes, log_fn)
    if path is not None and resume_mode == "auto":
        set_aside_newer(root, path, log_fn)
    return path


def set_aside_newer(root: str | Path, resume: Path, log_fn: Callable[[str], None] | None = None) -> list[Path]:
    """Rename every complete checkpoint newer than `resume` (in `auto` mode: those that failed verification) to
    `global_step_N.damaged` (`.damaged-2`, ... if taken), out of the run's way, then point `latest` at `resume`.

    The run resuming from `resume` writes those steps again, and `commit` refuses to replace a complete checkpoint
    of another run (or the one `latest` names): left in place, they would fail its first save. Renamed, not deleted:
    a damaged checkpoint may still be restored by hand. Call while holding the RunLock.
    """
    root, resume_step = Path(root), step_of(resume)
    moved = []
    for step, path in sorted(complete_steps(root).items()):
        if step <= resume_step:
            continue
        aside, n = root / f"{path.name}.damaged", 1
        while aside.exists():
            n += 1
            aside = root / f"{path.name}.damaged-{n}"
        os.rename(path, aside)
        moved.append(aside)
        (log_fn or log.warning)(
            f"moved {path} aside to {aside}: the run resumes from {resume} and will write step {step} again "
            "(delete it once it is no longer needed)"
        )
    if moved and read_latest_step(root) != resume_step:
        write_latest(root, resume_step)
    return moved


def choose_resume(
    root: str | Path,
    resume_mode: str,
    resume_from_path: str | Path | None = None,
    hashes: bool = True,
    log_fn: Callable[[str], None] | None = None,
) -> Path | None:
    """`resume_point` without the cleanup (read-only, so config validation can call it)."""
    path = resolve_resume(root, resume_mode, resume_from_path)
    if path is None:
        return None
    if resume_mode == "resume_path":
        try:
            verify_checkpoint(path, hashes)
        except CheckpointError as exc:
            raise CheckpointError(f"trainer.resume_from_path={resume_from_path}: {exc}. Point it at another checkpoint") from exc
        return path
    steps = complete_steps(root)
    skipped = []
    for step in sorted(steps, reverse=True):
        try:
            verify_checkpoint(steps[step], hashes)
        except CheckpointError as exc:
            skipped.append(str(exc))
            (log_fn or log.warning)(f"skipping checkpoint {steps[step]} for resume: {exc}")
            continue
        if skipped:
            (log_fn or log.warning)(f"resuming from {steps[step]}, the newest checkpoint that matches its manifest")
        return steps[step]
    raise CheckpointError(
        f"no checkpoint under {root} matches its manifest, so trainer.resume_mode=auto cannot resume:\n  "
        + "\n  ".join(skipped)
        + f"\nRestore the damaged files, or move the damaged global_step_N folders out of {root} to start fresh, "
        f"or start a new experiment (trainer.experiment_name=<new name>)"
    )


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


_WRITER_PID = re.compile(r"_(\d+)$")


def cleanup_partial(root: str | Path) -> list[Path]:
    """Remove `.tmp_*` leftovers of crashed saves; call while holding the RunLock.

    The lock keeps other runs out; a leftover whose writer (the pid its name ends with) is still alive on this
    host is kept all the same, since a process of this run may be writing it (a checkpoint is written by the
    `fit_epoch` worker, not the process that holds the lock).
    """
    root = Path(root)
    if not root.is_dir():
        return []
    holder = read_lock(root / LOCK_FILE) or {}
    same_host = holder.get("host") in (None, socket.gethostname())
    removed = []
    for path in sorted(root.iterdir()):
        if not path.name.startswith(TMP_PREFIX):
            continue
        m = _WRITER_PID.search(path.name)
        if m and same_host and int(m.group(1)) != os.getpid() and pid_alive(int(m.group(1))):
            log.info("keeping %s: its writer (pid %s) is alive", path, m.group(1))
            continue
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append(path)
    if removed:
        log.info("removed %d partial checkpoint leftovers under %s", len(removed), root)
    return removed


def apply_retention(
    root: str | Path, max_keep: int | None, protect: set[int] | frozenset[int] = frozenset(), run_id: str | None = None
) -> list[Path]:
    """Delete the oldest complete checkpoints beyond `max_keep` (None: keep all), except protected and latest.

    With `run_id`, only checkpoints of that run count, plus other runs' checkpoints older than its oldest one
    (the history it continued from, e.g. a resumed experiment); another run's checkpoint newer than that is
    never deleted. Protected and latest checkpoints survive even if that keeps more than `max_keep`; returns
    what was deleted.
    """
    if max_keep is None:
        return []
    if max_keep < 1:
        raise ValueError(f"trainer.max_actor_ckpt_to_keep={max_keep} must be >= 1 or null (keep all)")
    root = Path(root)
    steps = complete_steps(root)
    if run_id is not None:
        ours = [s for s in steps if run_id_of(steps[s]) == run_id]
        first = min(ours, default=-1)
        steps = {s: p for s, p in steps.items() if s in ours or s < first}
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
