"""The training actor's step on the real tiny model (in-process, no Ray): ratio 1, LoRA KL, checkpoints."""

from __future__ import annotations

import subprocess
import sys

import torch
from flow_utils import DIFFUSION_NFT, SMALL_ACTOR_STEP

from omni_core.config import load_config
from omni_core.rollout.sampler import generate
from omni_core.rollout.sampling_params import SamplingParams
from omni_core.workers.training_actor import TrainingActor

SMALL = SMALL_ACTOR_STEP


def _rollout(actor: TrainingActor, step: int):
    params = SamplingParams.for_training(actor.config.actor_rollout_ref.rollout)
    return generate(actor.policy, ["a red circle", "a blue square"], prompt_indices=[0, 1], **params.generate_kwargs(step))


def test_lora_kl_is_zero_at_init_and_positive_after_an_update(tiny_sd3_dir, one_torch_thread):
    overrides = [
        *SMALL,
        f"actor_rollout_ref.model.path={tiny_sd3_dir}",
        "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.1",
    ]
    actor = TrainingActor(
        load_config(overrides=overrides).model_dump(mode="json"), total_training_steps=4, num_threads=1, text_encoders=True
    )
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.5, -0.5])
    first = actor.train_on(_rollout(actor, 1), advantages, 1)
    # LoRA's B starts at zero: the policy is the reference (adapters disabled) -> KL exactly 0, ratio exactly 1.
    assert first["actor/kl_loss"] == 0.0
    assert first["actor/ratio_mean"] == 1.0
    second = actor.train_on(_rollout(actor, 2), advantages, 2)
    assert second["actor/kl_loss"] > 0.0
    assert actor.get_version() == 2


def test_save_and_reset_restore_the_exact_weights(tiny_sd3_dir, one_torch_thread, tmp_path):
    cfg = load_config(overrides=[*SMALL, f"actor_rollout_ref.model.path={tiny_sd3_dir}"]).model_dump(mode="json")
    actor = TrainingActor(cfg, total_training_steps=4, num_threads=1, text_encoders=True)
    actor.train_on(_rollout(actor, 1), torch.linspace(-1, 1, 8), 1)
    saved = actor.get_weights()
    actor.save(str(tmp_path))
    actor.train_on(_rollout(actor, 2), torch.linspace(-1, 1, 8), 2)
    assert actor.reset(str(tmp_path)) == 1
    assert all(torch.equal(saved[k], v) for k, v in actor.get_weights().items())
    assert actor.reset(None) == 0  # back to the base model and a fresh optimizer
    assert not all(torch.equal(saved[k], v) for k, v in actor.get_weights().items())


def test_a_step_whose_groups_the_zero_std_filter_all_left_out_reads_nothing_and_updates_nothing(tiny_sd3_dir, one_torch_thread):
    """The controller passes no keys when every group tied (algorithm.filter_zero_std_groups): the rank reads no rows
    (the partition name is never used), makes no update and still reaches the step's version."""
    cfg = load_config(overrides=[*SMALL, f"actor_rollout_ref.model.path={tiny_sd3_dir}", "algorithm.filter_zero_std_groups=true"])
    actor = TrainingActor(cfg.model_dump(mode="json"), total_training_steps=4, num_threads=1)
    before = actor.get_weights()
    metrics = actor.train_step("no-such-partition", [], torch.zeros(0), 1)
    assert metrics["actor/zero_std_idle_step"] == 1.0 and actor.get_version() == 1
    assert all(torch.equal(before[k], v) for k, v in actor.get_weights().items())


def test_make_tiny_model_cli_writes_a_pipeline_diffusers_loads(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "omniflow.flows.cli", "make-tiny-model", str(tmp_path / "tiny-sd3")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(str(tmp_path / "tiny-sd3"))
    assert sum(p.numel() for p in pipe.transformer.parameters()) == 2_292_544


def test_a_diffusion_nft_checkpoint_holds_and_restores_the_old_policy(tiny_sd3_dir, one_torch_thread, tmp_path, caplog):
    cfg = load_config(
        overrides=[*SMALL, f"actor_rollout_ref.model.path={tiny_sd3_dir}", *DIFFUSION_NFT, "algorithm.old_policy_decay=0.5"]
    )
    actor = TrainingActor(cfg.model_dump(mode="json"), total_training_steps=4, num_threads=1, text_encoders=True)
    params = SamplingParams.for_training(cfg.actor_rollout_ref.rollout, "diffusion_nft")

    def train(step: int) -> None:
        traj = generate(actor.policy, ["a red circle", "a blue square"], prompt_indices=[0, 1], **params.generate_kwargs(step))
        actor.train_on(traj, torch.linspace(-1, 1, 8), step)

    train(1)
    old = {k: v.clone() for k, v in actor.trainer.old_policy.items()}
    written = actor.save(str(tmp_path))
    assert str(tmp_path / "actor" / "old_policy.safetensors") in written  # one of the checkpoint's files
    train(2)
    assert actor.reset(str(tmp_path)) == 1
    assert all(torch.equal(old[k], v) for k, v in actor.trainer.old_policy.items())
    # A checkpoint of a run without an old policy: it starts at the loaded weights, and the log says so.
    (tmp_path / "actor" / "old_policy.safetensors").unlink()
    assert actor.reset(str(tmp_path)) == 1
    trained = actor.trainer.trainable_state()
    assert all(torch.equal(trained[k], v) for k, v in actor.trainer.old_policy.items())
    assert "has no old policy" in caplog.text
