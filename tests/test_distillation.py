"""On-policy distillation (verl-omni's `distillation.*`, `loss_mode=distill_kl`, `actor.use_distill_loss`): the loss against
its closed form written out here, the switches validation ties together, and one whole flow in which the student moves
towards a teacher of other weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from omni_core.algorithms.loss_contract import LossInputs, LossSettings
from omni_core.algorithms.registry import get_policy_loss
from omni_core.config import ConfigError, load_config
from omni_core.validation import validate_config

CPU_ONLY_COUNTS = {"cuda": 0, "npu": 0, "cpu": 2}


def _closed_form(mean: torch.Tensor, teacher: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """verl-omni's DistillKLLoss: mean over the latent of (mu - mu_teacher)^2 / (2 std^2), then over the batch."""
    per_sample = ((mean - teacher) ** 2).flatten(1).mean(dim=1) / (2 * std.flatten() ** 2)
    return per_sample.mean()


def test_distill_kl_is_the_closed_form_and_vanishes_when_the_student_is_the_teacher():
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(3, 4, 2, 2, generator=g, requires_grad=True)
    teacher = torch.randn(3, 4, 2, 2, generator=g)
    std = torch.rand(3, 1, 1, 1, generator=g) + 0.5
    loss_fn, settings = get_policy_loss("distill_kl"), LossSettings(clip_ratio=0.2, adv_clip_max=5.0)
    assert loss_fn.inputs(settings) == {"prev_sample_mean", "std_dev_t", "teacher_prev_sample_mean"}
    loss, metrics = loss_fn(LossInputs(prev_sample_mean=mean, teacher_prev_sample_mean=teacher, std_dev_t=std), settings)
    torch.testing.assert_close(loss, _closed_form(mean, teacher, std))
    assert metrics["distill_kl_loss"] == pytest.approx(loss.item())
    same = teacher.clone().requires_grad_(True)
    zero, _ = loss_fn(LossInputs(prev_sample_mean=same, teacher_prev_sample_mean=teacher, std_dev_t=std), settings)
    zero.backward()
    assert zero.item() == 0.0 and torch.equal(same.grad, torch.zeros_like(same))
    loss.backward()  # the gradient pulls the student's mean towards the teacher's: (mu - mu_t) / (B D std^2)
    torch.testing.assert_close(mean.grad, (mean - teacher).detach() / (3 * 16 * std**2))


def test_use_distill_loss_adds_the_weighted_teacher_kl_to_flow_grpo():
    g = torch.Generator().manual_seed(1)
    b = 4
    mean, teacher = torch.randn(b, 2, 3, 3, generator=g), torch.randn(b, 2, 3, 3, generator=g)
    std = torch.full((b, 1, 1, 1), 0.7)
    log_prob, old = torch.randn(b, generator=g), torch.randn(b, generator=g)
    adv = torch.randn(b, generator=g)
    flow_grpo = get_policy_loss("flow_grpo")
    base = LossSettings(clip_ratio=0.2, adv_clip_max=5.0)
    with_teacher = LossSettings(clip_ratio=0.2, adv_clip_max=5.0, distill_coef=0.5)
    assert flow_grpo.inputs(with_teacher) - flow_grpo.inputs(base) == {"prev_sample_mean", "std_dev_t", "teacher_prev_sample_mean"}
    x = LossInputs(
        log_prob=log_prob, old_log_prob=old, advantages=adv, prev_sample_mean=mean, teacher_prev_sample_mean=teacher, std_dev_t=std
    )
    plain, _ = flow_grpo(x, base)
    total, metrics = flow_grpo(x, with_teacher)
    torch.testing.assert_close(total, plain + 0.5 * _closed_form(mean, teacher, std))
    assert metrics["distill_kl_loss"].item() == pytest.approx(_closed_form(mean, teacher, std).item())


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    """A teacher of the student's architecture and scheduler with other weights (the tiny SD3 of seed 1)."""
    from omni_core.models.tiny import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("teacher"), arch="sd3", seed=1)


def _problems(overrides: list[str]) -> dict[str, str]:
    try:
        validate_config(load_config(overrides=overrides), device_counts=CPU_ONLY_COUNTS)
    except ConfigError as err:
        return {p.key: str(p) for p in err.problems}
    return {}


def test_the_teacher_switch_goes_with_a_loss_that_reads_it(tiny_sd3_dir, teacher_dir, tmp_path):
    model = f"actor_rollout_ref.model.path={tiny_sd3_dir}"
    teacher = ["distillation.enabled=true", f"distillation.teacher_models.teacher_model.model_path={teacher_dir}"]
    pure = ["actor_rollout_ref.actor.diffusion_loss.loss_mode=distill_kl"]
    assert _problems([model, *teacher, *pure]) == {}
    assert _problems([model, *teacher, "actor_rollout_ref.actor.use_distill_loss=true"]) == {}
    assert "no loss reads" in _problems([model, *teacher])["distillation.enabled"]
    assert "set distillation.enabled=true" in _problems([model, *pure])["actor_rollout_ref.actor.diffusion_loss.loss_mode"]
    fm_mse = [model, *teacher, "actor_rollout_ref.actor.use_distill_loss=true", "actor_rollout_ref.actor.distill_loss_mode=distill_fm_mse"]
    assert "nothing produces" in _problems(fm_mse)["actor_rollout_ref.actor.distill_loss_mode"]
    missing = _problems([model, "distillation.enabled=true", *pure])
    assert "needs the teacher" in missing["distillation.teacher_models.teacher_model.model_path"]
    # A teacher on another noise grid (its scheduler's shift changed) cannot replay the student's transitions.
    other = tmp_path / "other-teacher"
    shutil.copytree(teacher_dir, other)
    config_file = other / "scheduler" / "scheduler_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "shift": 7.0}))
    grid = _problems([model, "distillation.enabled=true", f"distillation.teacher_models.teacher_model.model_path={other}", *pure])
    assert "shift" in grid["distillation.teacher_models.teacher_model.model_path"]


# ----------------------------------------------------------------------------- one whole flow
def _teacher_gap(model_dir: Path, teacher_dir: Path, checkpoint: Path | None) -> float:
    """Mean squared gap between the student's and the teacher's predicted velocity at fixed noisy latents, timesteps and
    prompts: the quantity distillation shrinks (the transition means differ by the velocity gap times dt)."""
    from omni_core.checkpoint.trained import load_checkpoint_weights
    from omni_core.models.policy import FlowPolicy

    student, teacher = FlowPolicy(str(model_dir)), FlowPolicy(str(teacher_dir), trainable=False)
    if checkpoint is not None:
        load_checkpoint_weights(student, checkpoint, ema=False)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, *student.latent_shape(32, 32), generator=g)
    t = torch.tensor([900.0, 700.0, 500.0, 300.0])
    cond = student.encode_prompts(["a red circle", "a blue square"] * 2, max_sequence_length=128)
    with torch.no_grad():
        return float(((student.velocity(x, t, cond) - teacher.velocity(x, t, cond)) ** 2).mean())


def test_a_distillation_run_moves_the_student_towards_the_teacher(
    prefect_api, ray_cluster, transfer_queue, flow_overrides, tiny_sd3_dir, teacher_dir, tmp_path
):
    """Pure distillation (loss_mode=distill_kl) through `main_diffusion_v1`: the teacher replays each stored transition
    in the training rank, the loss is positive at step 1 (other weights), the rewards are still scored, and after the
    run the student's velocity is closer to the teacher's than the base model's was."""
    from omniflow.flows.main_diffusion_v1 import main_diffusion_v1

    from omni_core.tracking import read_jsonl

    ckpt = tmp_path / "ckpt"
    overrides = [
        *flow_overrides,
        "distillation.enabled=true",
        f"distillation.teacher_models.teacher_model.model_path={teacher_dir}",
        "actor_rollout_ref.actor.diffusion_loss.loss_mode=distill_kl",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "trainer.val_before_train=false",
        f"trainer.default_local_dir={ckpt}",
    ]
    state = main_diffusion_v1(overrides=overrides, return_state=True)
    assert state.is_completed(), state.message
    (log_dir,) = (ckpt / "logs").iterdir()
    records = [r for r in read_jsonl(log_dir / "metrics.jsonl") if "actor/distill_kl_loss" in r]
    assert len(records) == 2 and "actor/pg_loss" not in records[0]
    assert records[0]["actor/distill_kl_loss"] > 0 and "critic/rewards/mean" in records[0]
    before = _teacher_gap(tiny_sd3_dir, teacher_dir, None)
    after = _teacher_gap(tiny_sd3_dir, teacher_dir, ckpt / "global_step_2")
    assert after < before, (before, after)
