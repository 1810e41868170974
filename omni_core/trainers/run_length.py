"""How long a run is: its training steps, and whether the checkpoint it resumes from is already the last one.

No Ray: the flow asks `finished_step` before it starts anything, so a re-run of a finished
experiment (the on-demand deployment triggered again from the UI) returns at once instead of loading every model to
train nothing.
"""

from __future__ import annotations

from omni_core import checkpoint as ckpt
from omni_core.checkpoint.layout import parse_step
from omni_core.config import OmniFlowConfig
from omni_core.config.schema import TrainerConfig
from omni_core.data.dataloader import batches_per_epoch


def total_training_steps(trainer: TrainerConfig, steps_per_epoch: int) -> int:
    """`trainer.total_training_steps`, or `trainer.total_epochs` whole epochs of `steps_per_epoch` (verl's rule)."""
    return trainer.total_training_steps or steps_per_epoch * trainer.total_epochs


def finished_step(config: OmniFlowConfig, resume_from: str | None, train_prompts: int) -> int | None:
    """The step of `resume_from` when no training step is left after it, else None.

    `train_prompts`: the prompts of the training set (the loader's batches per epoch follow from it). A `val_only`
    run is never finished (it validates the checkpoint). The checkpoint's every byte is hashed first, as the run would
    before resuming it: a damaged last checkpoint is not "finished" (the run falls back to an older one)."""
    if resume_from is None or config.trainer.val_only:
        return None
    step = parse_step(resume_from)
    steps = total_training_steps(config.trainer, batches_per_epoch(train_prompts, config.data.train_batch_size))
    if step is None or step < steps:
        return None
    try:
        ckpt.verify_checkpoint(resume_from, hashes=True)
    except ckpt.CheckpointError:
        return None  # the run resumes the newest checkpoint that verifies, or reports why none does
    return step
