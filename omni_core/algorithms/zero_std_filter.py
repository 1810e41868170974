"""flow_grpo's filter of prompt groups without a learning signal (`algorithm.filter_zero_std_groups`).

A group whose rewards are all equal has advantage 0 for every sample under a group-centred estimator
(A_i = (r_i - mean_g) / std), so it carries no policy gradient; trained anyway, it dilutes the loss's mean over the
batch and still pays the KL term. flow_grpo (`scripts/train_sd3.py`) drops such samples before the update, then puts
randomly chosen dropped ones back until the kept count is a multiple of its number of batches, so that the batches
stay equal.

Here the unit dropped or put back is the prompt group (its samples' rewards, failed samples left out as in the
advantages), and the multiple is the update's mini-batch count times the data-parallel ranks, in samples: every
mini-batch then holds the same number of samples and every rank the same share of it. Plain tensors in, indices out.
"""

from __future__ import annotations

import torch
from torch import Tensor

# The prompt index in the seed of the filter's random draw (`rollout.sampler.derive_sample_seed`, with the step and the
# local update's index): no prompt has it, and the training noise of the forward-process losses uses -2.
SEED_PROMPT_INDEX = -3


def mini_batches_per_update(train_batch_size: int, ppo_mini_batch_size: int) -> int:
    """The number of mini-batches (optimizer steps per PPO epoch) an update makes, which the filter keeps: the kept
    samples are padded to a multiple of it (times the ranks) and the mini-batches shrink instead."""
    return train_batch_size // ppo_mini_batch_size


def informative_groups(rewards: Tensor, failed: Tensor, group: Tensor) -> Tensor:
    """`[G]` bool: True for each group id 0..G-1 whose successful samples do not all share one reward. A group with
    fewer than two successful samples has no spread either (its advantages are 0)."""
    n_groups = int(group.max()) + 1 if group.numel() else 0
    out = torch.zeros(n_groups, dtype=torch.bool)
    for g in range(n_groups):
        ok = rewards[(group == g) & ~failed]
        out[g] = ok.numel() >= 2 and bool((ok != ok[0]).any())
    return out


def groups_to_train(
    rewards: Tensor, failed: Tensor, group: Tensor, multiple: int, generator: torch.Generator
) -> tuple[Tensor, dict[str, float]]:
    """The sample indices (sorted) of the groups a step trains, and the filter's metrics.

    Every informative group is kept; then dropped groups, drawn at random with `generator`, are put back one at a time
    until the kept samples are a multiple of `multiple` (flow_grpo's rule, per group). When no group is informative
    nothing is kept (flow_grpo then trains nothing). Groups hold equal numbers of samples (rollout.n), so the full batch
    is such a multiple and the loop always ends.
    """
    if multiple <= 0:
        raise ValueError(f"multiple={multiple} must be positive")
    keep = informative_groups(rewards, failed, group)
    sizes = torch.bincount(group, minlength=keep.numel())
    informative = int(keep.sum())
    if informative:
        dropped = torch.nonzero(~keep).flatten()
        for g in dropped[torch.randperm(dropped.numel(), generator=generator)].tolist():
            if int(sizes[keep].sum()) % multiple == 0:
                break
            keep[g] = True
    if int(sizes[keep].sum()) % multiple:
        raise ValueError(f"groups of sizes {sizes.tolist()} cannot make a multiple of {multiple} samples")
    indices = torch.nonzero(keep[group]).flatten()
    trained = int(keep.sum())
    metrics = {
        "training/zero_std_filter/dropped_groups": float(keep.numel() - trained),
        "training/zero_std_filter/padded_groups": float(trained - informative),
        "training/zero_std_filter/trained_groups": float(trained),
    }
    return indices, metrics
