"""Learning goes the right way: tests that negating the advantages (or evaluating the base model as the trained one)
makes fail, which the flow-level oracles comparing one run with another cannot see (docs/design.md section 6).

1. One training step on real rewards, in-process (no Ray, no Prefect): the tiny SD3 samples two prompt groups with the
   rollout's sampler, the built-in `jpeg_compressibility` reward scores them through the reward manager, the trainer's
   own `step_advantages` turns the rewards into advantages, and the training actor's `train_on` updates the policy.
   The log-probs of the same stored trajectories, recomputed before and after with the actor's own log-prob pass,
   rise for each group's best sample relative to its worst.
2. A short whole run of `main_diffusion_v1` (in-process, the session's Prefect API, Ray cluster and TransferQueue) with
   the example brightness reward: the mean reward of its last steps stands out of its first steps' by a stated
   multiple of its own step-to-step noise (`TrainResult.reward_step_noise`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from flow_utils import SMALL_ACTOR_STEP

from omni_core.config import load_config
from omni_core.rewards.manager import RewardManager
from omni_core.rollout.sampler import generate_groups
from omni_core.rollout.sampling_params import SamplingParams
from omni_core.trainers.base import step_advantages
from omni_core.workers.training_actor import TrainingActor

PROMPTS = ["a red circle", "a blue square"]
N = 4  # samples per prompt (SMALL_ACTOR_STEP's rollout.n)

# One step of 2 prompts x 4 samples = one mini-batch (one optimizer step), 32 px, 4 denoising steps of which the SDE
# window takes 2 (Flow-GRPO-Fast's default window, starting in 0..3).
SMALL_STEP = [*SMALL_ACTOR_STEP, "actor_rollout_ref.actor.optim.lr_warmup_steps=-1"]


def test_a_policy_update_on_real_rewards_raises_the_best_sample_against_the_worst(tiny_sd3_dir, one_torch_thread):
    cfg = load_config(overrides=[*SMALL_STEP, f"actor_rollout_ref.model.path={tiny_sd3_dir}"])
    actor = TrainingActor(cfg.model_dump(mode="json"), total_training_steps=4, num_threads=1, text_encoders=True)
    params = SamplingParams.for_training(cfg.actor_rollout_ref.rollout)
    traj = generate_groups(actor.policy, PROMPTS, prompt_indices=[0, 1], **params.generate_kwargs(1))
    scored = RewardManager(cfg.reward).score(traj.images, "jpeg_compressibility", prompts=traj.prompts)
    assert not scored.failed.any()
    rewards = scored.scores
    assert rewards.view(2, N).std(dim=1).min() > 0  # every group has something to prefer

    advantages = step_advantages(cfg.algorithm, rewards, scored.failed, traj.prompt_index)
    before = actor._old_log_probs(traj).mean(dim=1)  # [B]: the log-prob per SDE step of each stored trajectory
    metrics = actor.train_on(traj, advantages, 1)
    after = actor._old_log_probs(traj).mean(dim=1)
    assert metrics["actor/ratio_mean"] == 1.0  # the update started on-policy: its first ratio is exactly 1
    rise = after - before

    # Each group's best and worst sample by reward: the best one's log-prob rises relative to the worst one's.
    best = rewards.view(2, N).argmax(dim=1) + torch.arange(2) * N
    worst = rewards.view(2, N).argmin(dim=1) + torch.arange(2) * N
    margin = rise[best] - rise[worst]  # measured (rollout seeds 0-5, 7-9, 42): 0.002-0.031, all > 0
    assert (margin > 0).all(), (rewards.tolist(), advantages.tolist(), rise.tolist())
    # And over the whole batch: the surrogate sum(A * log p) rose (a gradient step on it, to first order).
    assert float((advantages * rise).sum()) > 0


# A run that learns in few steps: the example brightness reward (mean pixel / 255; the random tiny SD3 draws ~0.44),
# lr 5e-3, every SDE step trained (window null, as `make run`), one epoch of STEPS steps of 2 prompts x 4 samples,
# no validation. Measured: (last - first) / noise 9.1, 17.4 and 19.6 for this run at rollout seeds 42 (the default),
# 0 and 1; 7.3-31.3 in-process with the same components (seeds 0-5); -5.5 with the advantages negated. The threshold:
# the difference of two 3-step means of a run that learns nothing has a std of ~0.8 noise, so 3x noise is ~3.7 of its
# std above no learning.
BRIGHTNESS = Path(__file__).resolve().parents[1] / "examples" / "rewards" / "brightness_reward.py"
STEPS = 10
MIN_RISE_IN_NOISE = 3.0  # (reward_last - reward_first) / reward_step_noise, each a 3-step mean


@pytest.mark.timeout(600)
def test_a_short_run_raises_the_reward_by_a_multiple_of_its_step_noise(
    prefect_api, ray_cluster, transfer_queue, flow_overrides, tmp_path
):
    from omniflow.flows.main_diffusion_v1 import main_diffusion_v1

    colours, shapes = ["red", "blue", "green", "yellow", "white"], ["circle", "square", "triangle", "star"]
    prompts = [f"a {c} {s}" for c in colours for s in shapes][: 2 * STEPS]
    (tmp_path / "train.txt").write_text("\n".join(prompts) + "\n")
    state = main_diffusion_v1(
        overrides=[
            *flow_overrides,
            f"data.train_files={tmp_path / 'train.txt'}",
            f"reward.custom_reward_function.path={BRIGHTNESS}",
            "actor_rollout_ref.actor.optim.lr=5e-3",
            "actor_rollout_ref.rollout.algo.sde_window_size=null",
            "actor_rollout_ref.rollout.algo.sde_window_range=null",
            "actor_rollout_ref.actor.optim.lr_warmup_steps=-1",
            "trainer.total_epochs=1",
            "trainer.val_before_train=false",
            f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        ],
        return_state=True,
    )
    assert state.is_completed(), state.message
    result = state.result()
    assert result.global_step == STEPS
    rise = (result.reward_last - result.reward_first) / result.reward_step_noise
    print(f"brightness {result.reward_first:.5f} -> {result.reward_last:.5f}, noise {result.reward_step_noise:.5f}: {rise:.1f}x")
    assert rise >= MIN_RISE_IN_NOISE, (result.reward_first, result.reward_last, result.reward_step_noise)
