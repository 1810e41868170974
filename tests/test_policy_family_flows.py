"""GRPO-Guard, Flow-DPPO and MixGRPO through the whole flow: one run each of the suite's lean config (2 epochs of one
step, 2 prompts x 4 samples, on the session's Ray cluster, TransferQueue and Prefect API) with only the key that selects
the algorithm changed (`diffusion_loss.loss_mode`; MixGRPO: `model.algorithm=mix_grpo`, random windows; DanceGRPO:
`rollout.algo.sde_type=dance_sde` with loss and estimator `dance_grpo`).

Each run completes and writes its checkpoint; its first step is on-policy, so the loss's ratio is exactly 1.0 (GRPO-
Guard: the old pass's means equal the update's first forward's bit for bit, so the drift term is exactly 0; Flow-DPPO:
every KL is 0 and nothing is masked); the loss's own diagnostics reach the run's metrics. Against Flow-GRPO's run of
the same config (`flow_reference`): each step of this config is one on-policy mini-batch, where Flow-DPPO's objective is
Flow-GRPO's (ratio 1 inside the clip range, nothing masked: both are -A r), so its weights must end bit-identical to
Flow-GRPO's; GRPO-Guard's ratio carries the step's scale s sigma and its loss 1 / s^2, MixGRPO trains other SDE
windows (one per step for all samples) and DanceGRPO samples another SDE, so theirs must differ.

DiffusionNFT, which shares neither the rollout nor the log-probs, has its own run: its old policy (a second LoRA
adapter) samples the rollouts and gives the loss's old predictions. So has online Diffusion-DPO, on two data-parallel
ranks each with its rollout worker: each prompt group's pair is made from samples of either worker and trained on one
rank.
"""

from __future__ import annotations

import pytest
import torch
from flow_utils import DIFFUSION_DPO, DIFFUSION_NFT, TWO_RANKS, final_weights

from omni_core.tracking import read_jsonl

pytestmark = pytest.mark.timeout(600)
# DanceGRPO on images as verl-omni names it: its SDE step, and Flow-GRPO's loss and advantages under DanceGRPO's names.
DANCE_GRPO = ["actor_rollout_ref.actor.diffusion_loss.loss_mode=dance_grpo", "algorithm.adv_estimator=dance_grpo"]


def _ode_lean(flow_overrides: list[str]) -> list[str]:
    """The lean config without its SDE window (the forward-process algorithms' ODE rollout refuses the key)."""
    return [o for o in flow_overrides if not o.startswith("actor_rollout_ref.rollout.algo.sde_window_range")]


def _records(ckpt) -> list[dict]:
    (log_dir,) = (ckpt / "logs").iterdir()
    return [r for r in read_jsonl(log_dir / "metrics.jsonl") if "critic/rewards/mean" in r]


@pytest.mark.parametrize(
    ("selects", "own_metric", "same_as_flow_grpo"),
    [
        ("actor_rollout_ref.actor.diffusion_loss.loss_mode=grpo_guard", "actor/ratio_mean_bias", False),
        ("actor_rollout_ref.actor.diffusion_loss.loss_mode=flow_dppo", "actor/masked_fraction", True),
        ("actor_rollout_ref.model.algorithm=mix_grpo", None, False),
        ("actor_rollout_ref.rollout.algo.sde_type=dance_sde", None, False),
    ],
    ids=["grpo_guard", "flow_dppo", "mix_grpo", "dance_grpo"],
)
def test_a_run_trains_with_the_algorithm_and_its_first_ratio_is_exactly_one(
    selects, own_metric, same_as_flow_grpo, flow_overrides, flow_reference, tmp_path
):
    from omniflow.flows.main_diffusion_v1 import main_diffusion_v1

    ckpt = tmp_path / "ckpt"
    overrides = [
        *flow_overrides,
        *([selects] if "dance_sde" not in selects else [selects, *DANCE_GRPO]),
        "trainer.val_before_train=false",
        f"trainer.default_local_dir={ckpt}",
    ]
    state = main_diffusion_v1(overrides=overrides, return_state=True)
    assert state.is_completed(), state.message
    records = _records(ckpt)
    assert [r["actor/ratio_mean"] for r in records] == [1.0, 1.0]  # every step: one on-policy mini-batch
    if own_metric is not None:
        assert [r[own_metric] for r in records] == [0.0, 0.0]
    _, _, reference_ckpt = flow_reference
    ours, flow_grpo = final_weights(ckpt), final_weights(reference_ckpt)
    assert ours.keys() == flow_grpo.keys()
    assert all(torch.equal(ours[k], flow_grpo[k]) for k in ours) == same_as_flow_grpo


def test_a_diffusion_nft_run_trains_on_policy_from_its_old_policy_and_checkpoints_it(flow_overrides, tmp_path):
    """DiffusionNFT through the whole flow (its ODE rollout, sampled with the old policy, and the forward-process update):
    with verl-omni's default `copy` refresh the old policy is the trained one at each step's start, so the old
    predictions of every step equal the current ones exactly (`old_deviate` 0: the rollout and the update ran on the
    old policy the refresh left); half the 4 schedule steps train per sample; the checkpoint holds the old policy next
    to the model, equal to it."""
    from omniflow.flows.main_diffusion_v1 import main_diffusion_v1

    from omni_core.checkpoint.files import read_tensors

    ckpt = tmp_path / "ckpt"
    lean = _ode_lean(flow_overrides)
    overrides = [
        *lean,
        *DIFFUSION_NFT,
        "algorithm.timestep_fraction=0.5",
        "trainer.val_before_train=false",
        f"trainer.default_local_dir={ckpt}",
    ]
    state = main_diffusion_v1(overrides=overrides, return_state=True)
    assert state.is_completed(), state.message
    records = _records(ckpt)
    assert [r["actor/old_deviate"] for r in records] == [0.0, 0.0]
    assert all(r["actor/old_policy_refreshed"] == 1.0 and r["actor/old_policy_decay"] == 0.0 for r in records)
    assert all(0.0 < r["actor/reward_prob_mean"] < 1.0 and r["actor/grad_norm"] > 0 for r in records)
    assert "actor/pg_loss" not in records[0] and "actor/ratio_mean" not in records[0]  # no policy-gradient terms
    actor = ckpt / "global_step_2" / "actor"
    model, old = read_tensors(actor, "model"), read_tensors(actor, "old_policy")
    assert model.keys() == old.keys() and all(torch.equal(model[k], old[k]) for k in model)


def test_an_online_dpo_run_trains_each_groups_pair_on_two_ranks(flow_overrides, tmp_path):
    """Online Diffusion-DPO through the whole flow on two ddp ranks, each with its rollout worker (the hybrid engine):
    each step's 2 prompt groups of 4 samples (sampled by both workers) become 2 (chosen, rejected) pairs, one per rank.
    LoRA starts at zero, so the first step's forwards are the reference's exactly: every pair's loss is log 2 and none is
    implicitly right; the second step's differ. No policy-gradient term is computed."""
    import math

    from omniflow.flows.main_diffusion_v1 import main_diffusion_v1

    ckpt = tmp_path / "ckpt"
    lean = _ode_lean(flow_overrides)
    overrides = [
        *lean,
        *DIFFUSION_DPO,
        *TWO_RANKS,
        "actor_rollout_ref.rollout.agent.num_workers=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",  # one pair per rank and micro-batch
        "actor_rollout_ref.actor.diffusion_loss.dpo_beta=100",
        "trainer.val_before_train=false",
        f"trainer.default_local_dir={ckpt}",
    ]
    state = main_diffusion_v1(overrides=overrides, return_state=True)
    assert state.is_completed(), state.message
    records = _records(ckpt)
    assert len(records) == 2 and "actor/pg_loss" not in records[0] and "actor/ratio_mean" not in records[0]
    first, second = records
    assert first["actor/dpo_loss"] == pytest.approx(math.log(2.0), abs=1e-6) and first["actor/implicit_acc"] == 0.0
    assert first["actor/rewards/margins"] == 0.0 and first["actor/grad_norm"] > 0
    assert second["actor/dpo_loss"] != pytest.approx(math.log(2.0), abs=1e-6)
    assert all(r["actor/dpo_tied_pairs"] == 0.0 for r in records)  # the jpeg reward never ties
    assert (ckpt / "global_step_2" / "actor" / "model.safetensors").is_file()
