"""flow_grpo's zero-std filter (`algorithm.filter_zero_std_groups`, omni_core.algorithms.zero_std_filter) on hand-made
groups: which groups are left out, how many are put back and which, and the keys it cannot be combined with."""

from __future__ import annotations

import pytest
import torch

from omni_core.algorithms.zero_std_filter import groups_to_train, informative_groups
from omni_core.config import load_config
from omni_core.validation import config_problems

# Four prompt groups of rollout.n = 4 samples, in the order a step's keys come.
REWARDS = torch.tensor(
    [
        [0.5, 0.5, 0.5, 0.5],  # group 0: every reward equal
        [0.1, 0.9, 0.4, 0.6],  # group 1: a spread
        [1.0, 1.0, 1.0, 1.0],  # group 2: every reward equal
        [0.3, 0.3, 0.0, 0.3],  # group 3: equal among its successful samples (sample 2 failed)
    ]
).flatten()
FAILED = torch.zeros(16, dtype=torch.bool)
FAILED[14] = True
GROUP = torch.arange(4).repeat_interleave(4)


def _population_std(values: torch.Tensor) -> float:
    """The spread flow_grpo reads (np.std), written out: sqrt(mean((r - mean)^2))."""
    mean = sum(values.tolist()) / len(values)
    return (sum((v - mean) ** 2 for v in values.tolist()) / len(values)) ** 0.5


def test_a_group_is_informative_when_its_successful_rewards_differ():
    expected = [_population_std(REWARDS[(GROUP == g) & ~FAILED]) > 0 for g in range(4)]
    assert expected == [False, True, False, False]
    assert informative_groups(REWARDS, FAILED, GROUP).tolist() == expected
    # A group with one successful sample has no spread; one with a different failed reward neither.
    failed = torch.tensor([False, True, True, True])
    assert informative_groups(torch.tensor([0.1, 0.9, 0.4, 0.6]), failed, torch.zeros(4, dtype=torch.long)).tolist() == [False]


def test_only_groups_with_a_spread_are_trained_when_they_fill_whole_mini_batches():
    kept, metrics = groups_to_train(REWARDS, FAILED, GROUP, multiple=4, generator=torch.Generator().manual_seed(0))
    assert kept.tolist() == [4, 5, 6, 7]  # group 1's samples
    assert metrics == {
        "training/zero_std_filter/dropped_groups": 3.0,
        "training/zero_std_filter/padded_groups": 0.0,
        "training/zero_std_filter/trained_groups": 1.0,
    }


@pytest.mark.parametrize("seed", range(6))
def test_dropped_groups_are_put_back_at_random_until_the_samples_divide_evenly(seed):
    """8 samples per unit (e.g. 2 mini-batches x 2 ranks x 2 samples): group 1 alone is 4 samples, so one dropped
    group comes back, drawn by the generator; the same seed draws the same group."""
    kept, metrics = groups_to_train(REWARDS, FAILED, GROUP, multiple=8, generator=torch.Generator().manual_seed(seed))
    groups = sorted(set(GROUP[kept].tolist()))
    assert len(kept) == 8 and 1 in groups and len(groups) == 2
    assert metrics["training/zero_std_filter/padded_groups"] == 1.0 and metrics["training/zero_std_filter/dropped_groups"] == 2.0
    again, _ = groups_to_train(REWARDS, FAILED, GROUP, multiple=8, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(kept, again)


def test_the_padding_draws_every_dropped_group_over_seeds():
    drawn = set()
    for seed in range(40):
        kept, _ = groups_to_train(REWARDS, FAILED, GROUP, multiple=8, generator=torch.Generator().manual_seed(seed))
        drawn |= set(GROUP[kept].tolist()) - {1}
    assert drawn == {0, 2, 3}


def test_a_step_whose_groups_all_tie_trains_nothing():
    tied = torch.tensor([0.5] * 4 + [1.0] * 4)
    kept, metrics = groups_to_train(
        tied, torch.zeros(8, dtype=torch.bool), torch.arange(2).repeat_interleave(4), 4, torch.Generator().manual_seed(0)
    )
    assert kept.numel() == 0 and metrics["training/zero_std_filter/trained_groups"] == 0.0
    assert metrics["training/zero_std_filter/dropped_groups"] == 2.0


def test_the_key_is_refused_outside_the_policy_gradient_losses(tiny_sd3_dir):
    from flow_utils import DIFFUSION_DPO

    base = [f"actor_rollout_ref.model.path={tiny_sd3_dir}", "algorithm.filter_zero_std_groups=true"]
    assert not [
        p
        for p in config_problems(load_config(overrides=base), {"cuda": 0, "npu": 0, "cpu": 2})
        if p.key == "algorithm.filter_zero_std_groups"
    ]
    problems = [
        p
        for p in config_problems(load_config(overrides=[*base, *DIFFUSION_DPO]), {"cuda": 0, "npu": 0, "cpu": 2})
        if p.key == "algorithm.filter_zero_std_groups"
    ]
    assert len(problems) == 1 and "Diffusion-DPO" in problems[0].message, problems
