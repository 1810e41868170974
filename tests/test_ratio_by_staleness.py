"""Importance-ratio statistics per staleness level (separate_async): ppo_update, the training actor, the rank merge.

The unit tests train a table of log-probs, ``log_prob[sample, j] = theta[sample, j]`` (theta starts at 0), so that
the old log-probs alone set each ratio: ``old = -log(r)`` gives ``exp(0 - old) = r`` before any optimizer step.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_update import make_cfg
from torch import nn

from omni_core.algorithms.update import PPOUpdateConfig, StepOutput, ppo_update
from omni_core.config import load_config
from omni_core.rollout.sampler import generate
from omni_core.rollout.sampling_params import SamplingParams
from omni_core.workers.training_actor import TrainingActor
from omni_core.workers.training_ranks import merge_rank_metrics

torch.set_num_threads(1)

B, W = 8, 2  # samples, window steps
PREFIX = "training/off_policy/ratio"
STATS = ("mean", "min", "max", "clipfrac")


class LogProbTable(nn.Module):
    """The policy's log-prob of each (sample, window step) transition is one trained parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.theta = nn.Parameter(torch.zeros(B, W))


def table_step_fn(model: LogProbTable):
    def step_fn(micro, j):
        log_prob = model.theta[micro["sample"], j]
        return StepOutput(log_prob=log_prob, prev_sample_mean=log_prob.unsqueeze(-1), std_dev_t=1.0)

    return step_fn


# Each sample's staleness (three levels, mixed inside every micro-batch of 2) and its ratios at window steps 0 and 1.
STALENESS = torch.tensor([0.0, 0.25, 1.0, 0.25, 0.0, 0.25, 1.0, 0.25])
RATIOS = torch.tensor([[1.0, 1.0], [1.5, 0.5], [3.0, 2.0], [1.2, 0.8], [1.0, 1.05], [1.0, 1.0], [0.25, 1.0], [2.0, 1.0]])
# By hand, clip_ratio = 0.1 (clipped: |r - 1| > 0.1):
#   level 0    (samples 0, 4):       1, 1, 1, 1.05                   mean 4.05 / 4 = 1.0125, min 1,    max 1.05, clipped 0 / 4
#   level 0.25 (samples 1, 3, 5, 7): 1.5, .5, 1.2, .8, 1, 1, 2, 1    mean 9 / 8 = 1.125,     min 0.5,  max 2,    clipped 5 / 8
#   level 1    (samples 2, 6):       3, 2, .25, 1                    mean 6.25 / 4 = 1.5625, min 0.25, max 3,    clipped 3 / 4
BY_HAND = {
    "staleness_0": {"mean": 1.0125, "min": 1.0, "max": 1.05, "clipfrac": 0.0},
    "staleness_0.25": {"mean": 1.125, "min": 0.5, "max": 2.0, "clipfrac": 0.625},
    "staleness_1": {"mean": 1.5625, "min": 0.25, "max": 3.0, "clipfrac": 0.75},
}


def table_batch(staleness: torch.Tensor | None) -> dict[str, torch.Tensor]:
    batch = {
        "old_log_probs": -torch.log(RATIOS),
        "advantages": torch.tensor([1.0, -1.0] * (B // 2)),
        "sample": torch.arange(B),
    }
    if staleness is not None:
        batch["staleness"] = staleness
    return batch


def run_update(batch: dict[str, torch.Tensor], cfg: PPOUpdateConfig, lr: float = 1e-2) -> tuple[dict[str, float], LogProbTable]:
    model = LogProbTable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return ppo_update(model, optimizer, None, batch, step_fn=table_step_fn(model), cfg=cfg), model


def ratio_metrics(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith(PREFIX)}


def test_ratio_statistics_per_staleness_level_match_the_hand_computation():
    metrics, _ = run_update(
        table_batch(STALENESS), make_cfg(clip_ratio=0.1)
    )  # one mini-batch: every ratio is seen before its step
    expected = {f"{PREFIX}/{level}/{stat}": value for level, stats in BY_HAND.items() for stat, value in stats.items()}
    got = ratio_metrics(metrics)
    assert set(got) == set(expected)  # `:g` names: staleness_0, staleness_0.25, staleness_1
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6), key


def test_staleness_leaves_the_loss_the_update_and_the_other_metrics_unchanged():
    with_levels, model_a = run_update(table_batch(STALENESS), make_cfg(clip_ratio=10.0), lr=0.1)
    sync, model_b = run_update(table_batch(None), make_cfg(clip_ratio=10.0), lr=0.1)
    assert ratio_metrics(sync) == {}  # on-policy (sync) batches report no per-level figures
    assert {k: v for k, v in with_levels.items() if not k.startswith(PREFIX)} == sync
    assert torch.equal(model_a.theta, model_b.theta)
    assert not torch.equal(model_a.theta, torch.zeros(B, W))  # the update did move the policy


def test_statistics_over_shuffled_epochs_equal_a_naive_loop_over_every_ratio():
    """Two PPO epochs x two shuffled mini-batches: later calls see ratios moved by earlier optimizer steps."""
    gen = torch.Generator().manual_seed(3)
    staleness = torch.tensor([0.0, 0.25, 1.0])[torch.randint(0, 3, (B,), generator=gen)]
    batch = table_batch(staleness)
    batch["old_log_probs"] = 0.3 * torch.randn(B, W, generator=gen)  # ratios within ~exp(+-0.6): some clipped
    cfg = make_cfg(mini_batch_size=4, ppo_epochs=2, shuffle=True, clip_ratio=0.2)

    model = LogProbTable()
    seen: dict[float, list[float]] = {}  # level -> every ratio the loss saw, one float at a time
    step_fn = table_step_fn(model)

    def recording(micro, j):
        out = step_fn(micro, j)
        for i, s in enumerate(micro["staleness"].tolist()):
            seen.setdefault(s, []).append(math.exp(out.log_prob[i].item() - micro["old_log_probs"][i, j].item()))
        return out

    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    got = ratio_metrics(ppo_update(model, optimizer, None, batch, step_fn=recording, cfg=cfg))

    assert sum(len(r) for r in seen.values()) == 2 * B * W  # every (sample, step) of both epochs
    expected = {}
    for level, ratios in seen.items():
        key = f"{PREFIX}/staleness_{level:g}"
        expected[f"{key}/mean"] = sum(ratios) / len(ratios)
        expected[f"{key}/min"] = min(ratios)
        expected[f"{key}/max"] = max(ratios)
        expected[f"{key}/clipfrac"] = sum(abs(r - 1.0) > 0.2 for r in ratios) / len(ratios)
    assert set(got) == set(expected) and len(seen) == 3
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6), key
    clipfracs = [got[f"{PREFIX}/staleness_{level:g}/clipfrac"] for level in seen]
    assert any(0.0 < c < 1.0 for c in clipfracs), clipfracs  # the split is exercised, not all-or-nothing


def test_merge_over_ranks_takes_the_union_of_keys():
    s0, s1 = f"{PREFIX}/staleness_0", f"{PREFIX}/staleness_1"
    rank0 = {
        "actor/pg_loss": 1.0,
        "timing_s/update_actor": 2.0,
        "training/rollout_probs_diff_max": 0.1,
        **{f"{s0}/mean": 1.0, f"{s0}/min": 0.9, f"{s0}/max": 1.1, f"{s0}/clipfrac": 0.5},
    }
    rank1 = {  # this rank also trained samples of staleness 1, rank 0 none
        "actor/pg_loss": 3.0,
        "timing_s/update_actor": 5.0,
        "training/rollout_probs_diff_max": 0.3,
        **{f"{s0}/mean": 1.2, f"{s0}/min": 0.95, f"{s0}/max": 1.3, f"{s0}/clipfrac": 0.0},
        **{f"{s1}/mean": 2.0, f"{s1}/min": 1.5, f"{s1}/max": 3.0, f"{s1}/clipfrac": 1.0},
    }
    merged = merge_rank_metrics([rank0, rank1])
    assert merged == pytest.approx(
        {
            "actor/pg_loss": 2.0,  # mean
            "timing_s/update_actor": 5.0,  # the slowest rank
            "training/rollout_probs_diff_max": 0.3,  # the worst rank
            **{f"{s0}/mean": 1.1, f"{s0}/min": 0.9, f"{s0}/max": 1.3, f"{s0}/clipfrac": 0.25},
            **{f"{s1}/mean": 2.0, f"{s1}/min": 1.5, f"{s1}/max": 3.0, f"{s1}/clipfrac": 1.0},  # rank 1's alone
        }
    )
    assert merge_rank_metrics([rank1, rank0]).keys() == merged.keys()  # the union whichever rank comes first


def test_training_actor_passes_staleness_to_the_update(tiny_sd3_dir, one_torch_thread):
    """Old log-probs recomputed in the update's micro-batches, one mini-batch: every ratio is exactly 1 in fp32,
    whatever level a sample is labelled with."""
    overrides = [
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.pipeline.height=32",
        "actor_rollout_ref.rollout.pipeline.width=32",
        "actor_rollout_ref.rollout.pipeline.num_inference_steps=4",
        "actor_rollout_ref.rollout.algo.sde_window_range=[0,3]",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",  # x rollout.n = the whole batch of 8
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        f"actor_rollout_ref.model.path={tiny_sd3_dir}",
    ]
    actor = TrainingActor(load_config(overrides=overrides).model_dump(mode="json"), 4, num_threads=1, text_encoders=True)
    params = SamplingParams.for_training(actor.config.actor_rollout_ref.rollout)
    traj = generate(actor.policy, ["a red circle", "a blue square"], prompt_indices=[0, 1], **params.generate_kwargs(1))
    advantages = torch.linspace(-1, 1, 8)
    staleness = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])

    got = ratio_metrics(actor.train_on(traj, advantages, 1, staleness=staleness))
    assert got == {f"{PREFIX}/staleness_{level}/{stat}": 0.0 if stat == "clipfrac" else 1.0 for level in (0, 1) for stat in STATS}
    with pytest.raises(ValueError, match="one value per sample"):
        actor.train_on(traj, advantages, 2, staleness=staleness[:4])
    assert actor.get_version() == 1  # refused before the step: the actor is not marked as failed part-way
