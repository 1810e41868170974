"""What a training step does with samples whose reward failed: the failure-share rule and its error.

A reward that raises, returns NaN / inf or a non-number, or times out fails its sample (the rollout
worker also fails a sample whose SDE window is not finite). Failed samples get advantage 0 and stay out
of the group statistics; when more than ``reward.max_failure_ratio`` of a step's samples failed, or all
of them, the step raises :class:`RewardFailureError` before any update. Light (no torch), so the Prefect
layer can test for the class in its retry condition without paying for the reward code.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["RewardFailureError", "check_failure_share"]

# Reasons quoted in the error (one per failed prompt group, in group order).
_QUOTED_REASONS = 3


class RewardFailureError(RuntimeError):
    """Too many samples of a step failed their reward: a reward-code or data error that a retry would repeat.

    The message names the step, the share that failed, ``reward.max_failure_ratio`` and the first
    reasons (each starts with the failing reward term's label, e.g. ``my_reward.compute_score: ...``).
    Retry conditions should not retry it.
    """


def check_failure_share(
    num_failed: int, num_samples: int, max_failure_ratio: float, reasons: Sequence[str], *, step: int
) -> None:
    """Raise :class:`RewardFailureError` when every sample failed or more than ``max_failure_ratio`` of them.

    Args:
        num_failed: failed samples of the step.
        num_samples: all samples of the step (``train_batch_size x rollout.n``).
        max_failure_ratio: ``reward.max_failure_ratio`` (0 fails on any failure).
        reasons: why the failed prompt groups failed, first ones first.
        step: the global step, for the message.
    """
    if num_failed == 0 or num_samples == 0:
        return
    share = num_failed / num_samples
    if num_failed < num_samples and share <= max_failure_ratio:
        return
    what = (
        "every sample failed, so there is nothing to train on"
        if num_failed == num_samples
        else f"more than reward.max_failure_ratio={max_failure_ratio:g}"
    )
    quoted = "; ".join(reasons[:_QUOTED_REASONS]) or "no reason recorded"
    raise RewardFailureError(
        f"step {step}: {num_failed} of {num_samples} samples failed their reward or rollout ({share:.0%}: {what}); no update was "
        f"applied. First reasons: {quoted}. Fix the reward function named there (it must return a finite number "
        f"for every image), or raise reward.max_failure_ratio to train on the samples that succeed"
    )
