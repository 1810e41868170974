"""Algorithm options: the EMA of the weights, the KL on the velocity, and the detached unconditional CFG branch.

Math against hand-computed values; the training actor in-process on the tiny SD3; and one whole flow whose
validation samples with the EMA (hybrid engine) while training stays bit-identical to the reference run.
"""

from __future__ import annotations

import math

import pytest
import torch
from flow_utils import SMALL_ACTOR_STEP
from safetensors.torch import load_file

from omni_core.algorithms.ema import WeightsEMA, ema_decay
from omni_core.algorithms.flow_grpo import kl_loss, velocity_kl_loss
from omni_core.config import load_config
from omni_core.rollout.sampler import generate
from omni_core.rollout.sampling_params import SamplingParams
from omni_core.sde import sde_step_from_sigmas
from omni_core.validation import config_problems
from omni_core.workers.training_actor import TrainingActor

pytestmark = pytest.mark.xdist_group("separate_workers_run")  # shares that session run with other modules (conftest)

SMALL = SMALL_ACTOR_STEP


# ----------------------------------------------------------------------------------------------- EMA math
def test_ema_decay_warms_up_as_flow_grpo_and_is_capped():
    assert ema_decay(0, 0.9) == pytest.approx(0.1)  # (1 + 0) / (10 + 0)
    assert ema_decay(2, 0.9) == pytest.approx(0.25)  # 3 / 12
    assert ema_decay(80, 0.9) == 0.9  # 81 / 90 = 0.9 exactly: the cap
    assert ema_decay(1000, 0.9) == 0.9


def test_weights_ema_follows_the_rule_step_by_step():
    w = {"a": torch.tensor([0.0, 10.0])}
    ema = WeightsEMA(w, decay=0.5, start_step=2, update_interval=2)
    # Before start_step the average is the weights themselves.
    assert ema.step({"a": torch.tensor([1.0, 1.0])}, 1) is None
    assert ema.average["a"].tolist() == [1.0, 1.0]
    # k = 0 at step 2: d = min(0.5, 1/10) = 0.1 -> avg = 1 + 0.9 * (3 - 1) = 2.8
    assert ema.step({"a": torch.tensor([3.0, 3.0])}, 2) == pytest.approx(0.1)
    assert ema.average["a"].tolist() == pytest.approx([2.8, 2.8])
    # Step 3: k = 1 is not a multiple of update_interval=2: unchanged.
    assert ema.step({"a": torch.tensor([100.0, 100.0])}, 3) is None
    assert ema.average["a"].tolist() == pytest.approx([2.8, 2.8])
    # Step 4: k = 2, d = min(0.5, 3/12) = 0.25 -> avg = 2.8 + 0.75 * (6.8 - 2.8) = 5.8
    assert ema.step({"a": torch.tensor([6.8, 6.8])}, 4) == pytest.approx(0.25)
    assert ema.average["a"].tolist() == pytest.approx([5.8, 5.8])
    # Step 20: k = 18, d = min(0.5, 19/28) = 0.5 -> avg = 5.8 + 0.5 * (7.8 - 5.8) = 6.8
    assert ema.step({"a": torch.tensor([7.8, 7.8])}, 20) == 0.5
    assert ema.average["a"].tolist() == pytest.approx([6.8, 6.8])
    restored = WeightsEMA(w, decay=0.5, start_step=2, update_interval=2)
    restored.load_state_dict(ema.state_dict())
    assert torch.equal(restored.average["a"], ema.average["a"])
    with pytest.raises(ValueError, match="missing"):
        restored.load_state_dict({"b": torch.zeros(2)})


# ------------------------------------------------------------------------------------------- KL on velocity
def test_velocity_kl_is_the_mean_squared_velocity_gap():
    v = torch.tensor([[[1.0, 2.0]], [[0.0, 0.0]]])
    v_ref = torch.tensor([[[0.0, 0.0]], [[0.0, 3.0]]])
    # sample 0: (1 + 4) / 2 = 2.5; sample 1: 9 / 2 = 4.5; batch mean 3.5
    assert velocity_kl_loss(v, v_ref).item() == pytest.approx(3.5)


def test_transition_kl_is_the_velocity_gap_scaled_by_the_sde_step():
    """An independent relation: the flow SDE's transition means differ by the velocity gap times a factor of the step,
    so the transition KL equals the velocity form times factor^2 / (2 std^2): the two keys measure the same gap with
    different timestep weights."""
    torch.manual_seed(0)
    x, v, v_ref = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    sigma, sigma_next, sigma_max = torch.full((3,), 0.8), torch.full((3,), 0.6), torch.tensor(0.9)
    _, _, mean, std = sde_step_from_sigmas(v, x, sigma, sigma_next, sigma_max, 0.7, prev_sample=x)
    _, _, mean_ref, _ = sde_step_from_sigmas(v_ref, x, sigma, sigma_next, sigma_max, 0.7, prev_sample=x)
    gap = (mean - mean_ref) / (v - v_ref)  # the same factor everywhere for a linear step
    factor = gap.flatten()[0]
    assert torch.allclose(gap, factor.expand_as(gap), rtol=1e-4)
    std0 = std.flatten()[0]
    expected = velocity_kl_loss(v, v_ref) * factor**2 / (2 * std0**2)
    assert kl_loss(mean, mean_ref, std).item() == pytest.approx(expected.item(), rel=1e-4)


# ------------------------------------------------------------------------------------------ validation
def _problems(overrides: list[str]) -> list[str]:
    return [p.key for p in config_problems(load_config(overrides=overrides))]


def test_keys_that_would_do_nothing_are_refused(tiny_sd3_dir):
    base = [f"actor_rollout_ref.model.path={tiny_sd3_dir}"]
    assert "actor_rollout_ref.actor.kl_loss_type" in _problems([*base, "actor_rollout_ref.actor.kl_loss_type=velocity"])
    assert "actor_rollout_ref.actor.kl_loss_type" not in _problems(
        [*base, "actor_rollout_ref.actor.kl_loss_type=velocity", "actor_rollout_ref.actor.use_kl_loss=true"]
    )
    assert "actor_rollout_ref.actor.detach_uncond_cfg" in _problems([*base, "actor_rollout_ref.actor.detach_uncond_cfg=true"])
    assert "actor_rollout_ref.actor.ema.enable" in _problems(
        [*base, "actor_rollout_ref.actor.ema.enable=true", "actor_rollout_ref.actor.strategy=fsdp2"]
    )
    with pytest.raises(Exception, match="kl_loss_type"):
        load_config(overrides=[*base, "actor_rollout_ref.actor.kl_loss_type=low_var_kl"])  # verl's LLM value


# --------------------------------------------------------------------------------- detached CFG branch
def test_detached_unconditional_branch_keeps_the_value_and_drops_its_gradient(tiny_sd3_dir, one_torch_thread):
    from omni_core.models.policy import FlowPolicy

    cfg = load_config(overrides=[*SMALL, f"actor_rollout_ref.model.path={tiny_sd3_dir}"])
    policy = FlowPolicy.from_model_config(cfg.actor_rollout_ref.model, text_encoders=True)
    cond = policy.encode_prompts(["a red circle"], [""], 16, True)
    torch.manual_seed(0)
    latents, t, scale = torch.randn(1, 16, 16, 16), torch.tensor([700.0]), 4.0
    param = policy.transformer.proj_out.weight

    def grad_of(**kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        policy.transformer.zero_grad(set_to_none=True)
        out = policy.velocity(latents, t, cond, **kwargs)
        out.square().sum().backward()
        return out.detach(), param.grad.clone()

    full_value, full_grad = grad_of(guidance_scale=scale)
    value, grad = grad_of(guidance_scale=scale, detach_uncond=True)
    assert torch.equal(value, full_value)  # the same forward
    # With the unconditional branch u detached, d/dtheta sum(out^2) = sum(2 out * s * dc/dtheta): the gradient of
    # the conditional forward alone with the upstream 2 * s * out.
    policy.transformer.zero_grad(set_to_none=True)
    only_cond = {k: v for k, v in cond.items() if not k.startswith("negative_")}
    c = policy.velocity(latents, t, only_cond, guidance_scale=1.0)
    (c * (2 * scale * value)).sum().backward()
    assert torch.allclose(grad, param.grad, rtol=1e-3, atol=1e-6)
    assert not torch.allclose(grad, full_grad, rtol=1e-3)


# ------------------------------------------------------------------------------------- training actor
def _rollout(actor: TrainingActor, step: int):
    params = SamplingParams.for_training(actor.config.actor_rollout_ref.rollout)
    return generate(actor.policy, ["a red circle", "a blue square"], prompt_indices=[0, 1], **params.generate_kwargs(step))


def test_velocity_kl_in_the_actor_is_zero_at_init_and_positive_after_an_update(tiny_sd3_dir, one_torch_thread):
    overrides = [
        *SMALL,
        f"actor_rollout_ref.model.path={tiny_sd3_dir}",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_type=velocity",
        "actor_rollout_ref.actor.kl_loss_coef=0.1",
        "actor_rollout_ref.actor.optim.lr=1e-3",
    ]
    actor = TrainingActor(load_config(overrides=overrides).model_dump(mode="json"), 4, num_threads=1, text_encoders=True)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.5, -0.5])
    first = actor.train_on(_rollout(actor, 1), advantages, 1)
    assert first["actor/kl_loss"] == 0.0 and first["actor/ratio_mean"] == 1.0
    traj = _rollout(actor, 2)
    second = actor.train_on(traj, advantages, 2)
    assert second["actor/kl_loss"] > 0.0
    # Hand check of the first mini-batch's first term: the gap of the two policies' velocities on that transition.
    part = traj.index_select(torch.arange(4))
    with torch.no_grad():
        v_ref = actor._score(part, 0, use_reference=True).velocity
        v = actor._score(part, 0).velocity
    assert velocity_kl_loss(v, v_ref).item() > 0.0 and math.isfinite(second["actor/kl_loss"])


def test_ema_in_the_actor_checkpoint_and_export(tiny_sd3_dir, one_torch_thread, tmp_path):
    overrides = [
        *SMALL,
        f"actor_rollout_ref.model.path={tiny_sd3_dir}",
        "actor_rollout_ref.actor.ema.enable=true",
        "actor_rollout_ref.actor.ema.decay=0.9",
        "actor_rollout_ref.actor.optim.lr=1e-3",
    ]
    actor = TrainingActor(load_config(overrides=overrides).model_dump(mode="json"), 4, num_threads=1, text_encoders=True)
    base = actor.get_weights()
    advantages = torch.linspace(-1, 1, 8)
    m1 = actor.train_on(_rollout(actor, 1), advantages, 1)
    w1 = actor.get_weights()
    m2 = actor.train_on(_rollout(actor, 2), advantages, 2)
    w2 = actor.get_weights()
    d1, d2 = 2 / 11, 3 / 12  # min(0.9, (1 + k) / (10 + k)) at k = 1, 2
    assert m1["actor/ema_decay"] == pytest.approx(d1) and m2["actor/ema_decay"] == pytest.approx(d2)
    ema = actor.get_ema_weights()
    changed = 0
    for k, b in base.items():
        e1 = b + (1 - d1) * (w1[k] - b)
        expected = e1 + (1 - d2) * (w2[k] - e1)
        torch.testing.assert_close(ema[k], expected, rtol=1e-5, atol=1e-7)
        changed += int(not torch.equal(w2[k], b))
    assert changed > 0  # the weights did move, so the check above is not trivial

    actor.save(str(tmp_path))
    saved_ema = load_file(str(tmp_path / "actor" / "ema.safetensors"))
    assert all(torch.equal(saved_ema[k], v) for k, v in ema.items())
    exported = load_file(str(next((tmp_path / "actor" / "hf").glob("*.safetensors"))))
    assert all(torch.equal(exported[k], ema[k]) for k in exported)  # the diffusers copy ships the average
    model = load_file(str(tmp_path / "actor" / "model.safetensors"))
    assert all(torch.equal(model[k], w2[k]) for k in w2)  # training resumes from the trained weights

    actor.train_on(_rollout(actor, 3), advantages, 3)
    assert actor.reset(str(tmp_path)) == 2
    assert all(torch.equal(actor.get_ema_weights()[k], v) for k, v in ema.items())
    assert all(torch.equal(actor.get_weights()[k], v) for k, v in w2.items())


# ------------------------------------------------------------------------------------------- whole flow
@pytest.mark.parametrize("hybrid_engine", [True, False], ids=["hybrid_engine", "separate_workers"])
def test_ema_validation_leaves_training_bit_identical(flow_reference, flow_overrides, tmp_path, hybrid_engine, request):
    """EMA on, validation after every step with the average (hybrid engine: swapped into the ranks' modules and
    back; separate workers: sent the average, then the trained weights again): the trained weights must end exactly
    as the reference run's, and the checkpoint's average must be the rule applied to the reference's step weights.
    The separate-workers case is the session's shared run (two workers, one of them killed after step 1)."""
    from flow_utils import final_weights
    from omniflow.flows.main_diffusion_v1 import main_diffusion_v1

    _, _, ref_ckpt = flow_reference
    if hybrid_engine:
        ckpt = tmp_path / "ckpt"
        state = main_diffusion_v1(
            overrides=[
                *flow_overrides,
                "actor_rollout_ref.actor.ema.enable=true",
                "trainer.test_freq=1",
                f"trainer.default_local_dir={ckpt}",
            ],
            return_state=True,
        )
    else:
        state, ckpt, _ = request.getfixturevalue("separate_workers_run")
    assert state.is_completed(), state.message
    final = final_weights(ckpt)
    reference = final_weights(ref_ckpt)
    assert all(torch.equal(final[k], v) for k, v in reference.items())

    from diffusers import SD3Transformer2DModel

    base = SD3Transformer2DModel.from_pretrained(str(flow_overrides[0].split("=", 1)[1]), subfolder="transformer").state_dict()
    w1 = load_file(str(ref_ckpt / "global_step_1" / "actor" / "model.safetensors"))
    w2 = load_file(str(ref_ckpt / "global_step_2" / "actor" / "model.safetensors"))
    d1, d2 = 2 / 11, 3 / 12
    ema = load_file(str(ckpt / "global_step_2" / "actor" / "ema.safetensors"))
    for k, b in base.items():
        e1 = b + (1 - d1) * (w1[k] - b)
        torch.testing.assert_close(ema[k], e1 + (1 - d2) * (w2[k] - e1), rtol=1e-5, atol=1e-7)
    assert (ckpt / "validation" / "global_step_1.png").is_file() and (ckpt / "validation" / "global_step_2.png").is_file()
