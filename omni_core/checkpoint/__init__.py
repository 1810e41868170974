"""Checkpoints laid out as verl's (`<root>/global_step_N/`, `latest_checkpointed_iteration.txt`), written
atomically, with retention, resume resolution, a per-folder run lock and JSON RNG state.

Importing this package does not import torch (the file writers import it when called), so the flow
process and lock holders stay light. See `layout.py` for the folder layout.
"""

from omni_core.checkpoint.files import (
    actor_dir,
    read_config,
    read_state,
    read_tensors,
    read_torch_state,
    write_config,
    write_state,
    write_tensors,
    write_torch_state,
)
from omni_core.checkpoint.layout import CheckpointError, complete_steps, read_latest_step, step_dir, step_of
from omni_core.checkpoint.lock import RunLock, RunLockError, read_lock
from omni_core.checkpoint.resume import (
    apply_retention,
    choose_resume,
    cleanup_partial,
    find_latest,
    resolve_resume,
    resume_point,
)
from omni_core.checkpoint.rng import capture_rng_state, restore_rng_state
from omni_core.checkpoint.writer import (
    CheckpointWriter,
    DiskFullError,
    begin,
    check_free_space,
    checkpoint_summary,
    commit,
    disk_full_guard,
    read_manifest,
    run_id_of,
    verify_checkpoint,
    write_latest,
)

__all__ = [
    "CheckpointError",
    "CheckpointWriter",
    "DiskFullError",
    "RunLock",
    "RunLockError",
    "actor_dir",
    "apply_retention",
    "begin",
    "capture_rng_state",
    "check_free_space",
    "checkpoint_summary",
    "choose_resume",
    "cleanup_partial",
    "commit",
    "complete_steps",
    "disk_full_guard",
    "find_latest",
    "read_config",
    "read_latest_step",
    "read_lock",
    "read_manifest",
    "read_state",
    "read_tensors",
    "read_torch_state",
    "resolve_resume",
    "restore_rng_state",
    "resume_point",
    "run_id_of",
    "step_dir",
    "step_of",
    "verify_checkpoint",
    "write_config",
    "write_latest",
    "write_state",
    "write_tensors",
    "write_torch_state",
]
