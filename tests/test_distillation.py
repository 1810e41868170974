"""On-policy distillation (verl-omni's `distillation.*`, `loss_mode=distill_kl|distill_fm_mse`, `actor.use_distill_loss`):
each loss against its closed form written out here, the switches validation ties together, the teacher's velocities in
the training rank (no Ray), and one whole flow in which the student moves towards a teacher of other weights."""

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


def test_distill_fm_mse_is_the_mean_squared_velocity_gap_and_vanishes_when_the_student_is_the_teacher():
    """verl-omni's DistillFlowMatchingMSELoss: ((v - v_teacher)^2).mean() over every element; its gradient is
    2 (v - v_teacher) / N. As a term on flow_grpo (use_distill_loss) it adds coef x that and declares the velocities."""
    g = torch.Generator().manual_seed(2)
    v = torch.randn(3, 4, 2, 2, generator=g, requires_grad=True)
    v_teacher = torch.randn(3, 4, 2, 2, generator=g)
    loss_fn, settings = get_policy_loss("distill_fm_mse"), LossSettings(clip_ratio=0.2, adv_clip_max=5.0)
    assert loss_fn.inputs(settings) == {"velocity", "teacher_velocity"}
    loss, metrics = loss_fn(LossInputs(velocity=v, teacher_velocity=v_teacher), settings)
    expected = sum(float(a - b) ** 2 for a, b in zip(v.detach().flatten(), v_teacher.flatten(), strict=True)) / 48
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["distill_fm_mse_loss"] == pytest.approx(expected, rel=1e-6)
    loss.backward()
    torch.testing.assert_close(v.grad, 2 * (v - v_teacher).detach() / 48)
    same = v_teacher.clone().requires_grad_(True)
    zero, _ = loss_fn(LossInputs(velocity=same, teacher_velocity=v_teacher), settings)
    zero.backward()
    assert zero.item() == 0.0 and torch.equal(same.grad, torch.zeros_like(same))
    # The term on flow_grpo.
    b = 3
    log_prob, old, adv = torch.randn(b, generator=g), torch.randn(b, generator=g), torch.randn(b, generator=g)
    flow_grpo = get_policy_loss("flow_grpo")
    base = LossSettings(clip_ratio=0.2, adv_clip_max=5.0)
    term = LossSettings(clip_ratio=0.2, adv_clip_max=5.0, distill_coef=0.25, distill_mode="distill_fm_mse")
    assert flow_grpo.inputs(term) - flow_grpo.inputs(base) == {"velocity", "teacher_velocity"}
    x = LossInputs(log_prob=log_prob, old_log_prob=old, advantages=adv, velocity=v.detach(), teacher_velocity=v_teacher)
    plain, _ = flow_grpo(x, base)
    total, metrics = flow_grpo(x, term)
    assert total.item() == pytest.approx(plain.item() + 0.25 * expected, rel=1e-6)
    assert metrics["distill_fm_mse_loss"].item() == pytest.approx(expected, rel=1e-6)


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
    assert _problems(fm_mse) == {}
    assert _problems([model, *teacher, "actor_rollout_ref.actor.diffusion_loss.loss_mode=distill_fm_mse"]) == {}
    assert "set distillation.enabled=true" in _problems([model, "actor_rollout_ref.actor.diffusion_loss.loss_mode=distill_fm_mse"])[
        "actor_rollout_ref.actor.diffusion_loss.loss_mode"
    ]
    missing = _problems([model, "distillation.enabled=true", *pure])
    assert "needs the teacher" in missing["distillation.teacher_models.teacher_model.model_path"]
    # A teacher on another noise grid (its scheduler's shift changed) cannot replay the student's transitions.
    other = tmp_path / "other-teacher"
    shutil.copytree(teacher_dir, other)
    config_file = other / "scheduler" / "scheduler_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "shift": 7.0}))
    grid = _problems([model, "distillation.enabled=true", f"distillation.teacher_models.teacher_model.model_path={other}", *pure])
    assert "shift" in grid["distillation.teacher_models.teacher_model.model_path"]
    # A teacher of another architecture (its model_index.json says FLUX) cannot replay the SD3 student's transitions.
    flux = tmp_path / "flux-teacher"
    shutil.copytree(teacher_dir, flux)
    index = json.loads((flux / "model_index.json").read_text())
    (flux / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxPipeline"}))
    arch = _problems([model, "distillation.enabled=true", f"distillation.teacher_models.teacher_model.model_path={flux}", *pure])
    assert "FluxPipeline" in arch["distillation.teacher_models.teacher_model.model_path"] and "architecture" in arch[
        "distillation.teacher_models.teacher_model.model_path"
    ]


# ----------------------------------------------------------------------------- the gap to the teacher
def _teacher_gap(model_dir: Path, teacher_dir: Path, checkpoint: Path | None, student=None) -> float:
    """Mean squared gap between the student's and the teacher's predicted velocity at fixed noisy latents, timesteps and
    prompts: the quantity distillation shrinks (the transition means differ by the velocity gap times dt). The student
    is the model folder (with the checkpoint's weights), or `student`, a policy in memory."""
    from omni_core.checkpoint.trained import load_checkpoint_weights
    from omni_core.models.policy import FlowPolicy

    teacher = FlowPolicy(str(teacher_dir), trainable=False)
    if student is None:
        student = FlowPolicy(str(model_dir))
        if checkpoint is not None:
            load_checkpoint_weights(student, checkpoint, ema=False)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, *student.latent_shape(32, 32), generator=g)
    t = torch.tensor([900.0, 700.0, 500.0, 300.0])
    cond = student.encode_prompts(["a red circle", "a blue square"] * 2, max_sequence_length=128)
    with torch.no_grad():
        return float(((student.velocity(x, t, cond) - teacher.velocity(x, t, cond)) ** 2).mean())


def test_the_teacher_pass_gives_its_velocities_and_distill_fm_mse_moves_the_student_towards_them(
    tiny_sd3_dir, teacher_dir, one_torch_thread
):
    """In the training rank (no Ray): with `distill_fm_mse` the teacher replays each stored transition and hands the loss
    its velocity there: a teacher with the student's weights gives exactly the student's velocities (loss 0); a teacher
    of other weights gives a positive loss, and three updates shrink the gap to it measured at other points (fixed
    noise, timesteps and prompts). Mutation tried: with the term negated in the product the gap widened and this failed."""
    from flow_utils import SMALL_ACTOR_STEP

    from omni_core.rollout.sampler import generate
    from omni_core.rollout.sampling_params import SamplingParams
    from omni_core.workers.policy_trainer import PolicyTrainer

    def trainer(teacher: Path, lr: float) -> PolicyTrainer:
        overrides = [
            *SMALL_ACTOR_STEP,
            f"actor_rollout_ref.model.path={tiny_sd3_dir}",
            f"actor_rollout_ref.actor.optim.lr={lr}",
            "actor_rollout_ref.actor.diffusion_loss.loss_mode=distill_fm_mse",
            "distillation.enabled=true",
            f"distillation.teacher_models.teacher_model.model_path={teacher}",
        ]
        return PolicyTrainer(load_config(overrides=overrides), total_training_steps=4, text_encoders=True)

    def rollout(t: PolicyTrainer, step: int):
        params = SamplingParams.for_training(t.config.actor_rollout_ref.rollout)
        return generate(t.policy, ["a red circle", "a blue square"], prompt_indices=[0, 1], **params.generate_kwargs(step))

    itself = trainer(tiny_sd3_dir, 1e-3)
    assert {"velocity", "teacher_velocity"} <= itself.needs and "teacher_prev_sample_mean" not in itself.needs
    traj = rollout(itself, 1)
    teacher_v = itself.reference_predictions(traj)["teacher_velocity"]
    assert teacher_v.shape == traj.latents[:, 1:].shape
    for j in range(traj.window_size):
        own = itself.score(traj, j).velocity.detach().float()
        torch.testing.assert_close(teacher_v[:, j], own, rtol=1e-5, atol=1e-6)
    assert itself.train_on(traj, torch.zeros(8), 1)["actor/distill_fm_mse_loss"] == pytest.approx(0.0, abs=1e-10)

    student = trainer(teacher_dir, 1e-3)
    before = _teacher_gap(tiny_sd3_dir, teacher_dir, None, student=student.policy)
    losses = [student.train_on(rollout(student, step), torch.zeros(8), step)["actor/distill_fm_mse_loss"] for step in (1, 2, 3)]
    after = _teacher_gap(tiny_sd3_dir, teacher_dir, None, student=student.policy)
    assert after < before, (before, after, losses)
    assert losses[0] > 0


# ----------------------------------------------------------------------------- one whole flow
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
