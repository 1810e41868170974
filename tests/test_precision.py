"""Reduced precision: a bf16 / fp16 rollout copy, mixed-precision training with fp32 master weights (and a
gradient scaler for fp16), the rollout-vs-training log-prob drift metrics, and non-finite samples failing
with their reason. Plus the runtime keys around them: calculate_log_probs, the old-log-prob and reference
micro-batches, gen_batch_size / val_batch_size chunking.
"""

from __future__ import annotations

import math

import pytest
import torch

from omni_core.config import load_config
from omni_core.models.placement import rollout_policy_kwargs
from omni_core.models.policy import FlowPolicy
from omni_core.rollout.request import RolloutRequest
from omni_core.rollout.sampler import generate
from omni_core.rollout.sampling_params import SamplingParams
from omni_core.workers.rollout_worker import nonfinite_reasons
from omni_core.workers.training_actor import TrainingActor, rollout_probs_diff

SMALL = [
    "trainer.device=cpu",
    "data.train_batch_size=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.pipeline.height=32",
    "actor_rollout_ref.rollout.pipeline.width=32",
    "actor_rollout_ref.rollout.pipeline.num_inference_steps=4",
    "actor_rollout_ref.rollout.algo.sde_window_range=[0,3]",
]
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.5, -0.5])
# bf16 keeps 8 mantissa bits; the ratio of two log-probs recomputed with the same bf16 kernels is 1 up to the
# rounding of the different (with / without grad) code paths: far below the clip range of 1e-4 would be too
# strict for fp16/bf16 on other hardware, so the bound is 1e-3.
RATIO_TOL = 1e-3


def _step(tiny_sd3_dir, *overrides: str, step: int = 1):
    """One in-process training step: a rollout copy samples, the training actor updates on its trajectories."""
    cfg = load_config(overrides=[*SMALL, f"actor_rollout_ref.model.path={tiny_sd3_dir}", *overrides])
    actor = TrainingActor(cfg.model_dump(mode="json"), total_training_steps=2, num_threads=1)
    rollout = FlowPolicy.from_model_config(cfg.actor_rollout_ref.model, **rollout_policy_kwargs(cfg, None))
    rollout.load_trainable_state(actor.get_weights())
    params = SamplingParams.for_training(cfg.actor_rollout_ref.rollout)
    traj = generate(rollout, ["a red circle", "a blue square"], prompt_indices=[0, 1], **params.generate_kwargs(step))
    return actor, traj, actor.train_on(traj, ADVANTAGES, step)


def test_fp32_rollout_and_training_agree_bit_for_bit(tiny_sd3_dir, one_torch_thread):
    """The first ratio is exactly 1 (old and new log-probs come from one code path). A separate fp32 rollout copy
    agrees with the recomputation to fp32 rounding: 0 on the machines this was written on, 1.2e-7 on an AVX-512 CPU
    where two copies of one model differ by ~1 ulp in some layers (the same layer replayed on a copy of its input
    agrees bit for bit)."""
    _, traj, metrics = _step(tiny_sd3_dir)
    assert metrics["actor/ratio_mean"] == 1.0
    assert metrics["training/rollout_probs_diff_max"] <= 1e-6
    assert metrics["training/rollout_probs_diff_mean"] <= metrics["training/rollout_probs_diff_max"]


def test_bf16_rollout_and_bf16_training_report_their_drift(tiny_sd3_dir, one_torch_thread):
    actor, traj, metrics = _step(
        tiny_sd3_dir, "actor_rollout_ref.rollout.dtype=bfloat16", "actor_rollout_ref.actor.fsdp_config.dtype=bfloat16"
    )
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert abs(metrics["actor/ratio_mean"] - 1.0) < RATIO_TOL
    # A bf16 rollout's log-probs differ from the training side's recomputation: the drift is visible.
    assert 0.0 < metrics["training/rollout_probs_diff_mean"] <= metrics["training/rollout_probs_diff_max"]
    assert "actor/grad_scale" not in metrics  # bf16 needs no loss scaling
    # fp32 master weights: the update moved the fp32 parameters.
    assert {p.dtype for p in actor.policy.trainable_parameters()} == {torch.float32}


def test_fp16_training_runs_with_a_gradient_scaler(tiny_sd3_dir, one_torch_thread, tmp_path):
    actor, _, metrics = _step(
        tiny_sd3_dir, "actor_rollout_ref.rollout.dtype=float16", "actor_rollout_ref.actor.fsdp_config.dtype=float16"
    )
    assert actor.grad_scaler is not None
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert abs(metrics["actor/ratio_mean"] - 1.0) < RATIO_TOL
    assert metrics["actor/grad_scale"] > 0
    # The scaler's state is part of the checkpoint, so a resumed run continues with the same scale.
    actor.save(str(tmp_path))
    assert (tmp_path / "actor" / "grad_scaler.pt").is_file()
    scale = actor.grad_scaler.get_scale()
    actor.grad_scaler.update(1.0)
    actor.reset(str(tmp_path))
    assert actor.grad_scaler.get_scale() == scale


def test_without_rollout_log_probs_there_is_no_drift_metric(tiny_sd3_dir, one_torch_thread):
    _, traj, metrics = _step(tiny_sd3_dir, "actor_rollout_ref.rollout.calculate_log_probs=false")
    assert torch.isnan(traj.log_probs).all()
    assert not any(k.startswith("training/rollout_probs_diff") for k in metrics)
    assert metrics["actor/ratio_mean"] == 1.0


def test_old_log_prob_and_reference_micro_batches_are_what_the_keys_say(tiny_sd3_dir, one_torch_thread):
    cfg = load_config(
        overrides=[
            *SMALL,
            f"actor_rollout_ref.model.path={tiny_sd3_dir}",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        ]
    )
    actor = TrainingActor(cfg.model_dump(mode="json"), total_training_steps=2, num_threads=1, text_encoders=True)
    params = SamplingParams.for_training(cfg.actor_rollout_ref.rollout)
    traj = generate(actor.policy, ["a red circle", "a blue square"], prompt_indices=[0, 1], **params.generate_kwargs(1))
    batch_sizes: list[int] = []
    hook = actor.policy.base_transformer.register_forward_pre_hook(
        lambda _m, args, kwargs: batch_sizes.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    try:
        old = actor._old_log_probs(traj)
        calls_old = list(batch_sizes)
        batch_sizes.clear()
        actor.policy.ensure_reference()
        hook_ref = actor.policy._reference.register_forward_pre_hook(
            lambda _m, args, kwargs: batch_sizes.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
        )
        ref = actor._reference_targets(traj)
        hook_ref.remove()
    finally:
        hook.remove()
    window = traj.window_size
    assert calls_old == [2] * (4 * window)  # 8 samples in micro-batches of 2, per window step
    assert batch_sizes == [8] * window  # the reference pass: one micro-batch of 8 per window step
    assert torch.allclose(old, traj.log_probs, atol=1e-5)  # a different split, the same numbers up to rounding
    assert ref.shape == traj.latents[:, 1:].shape and torch.isfinite(ref).all()


def test_a_non_finite_window_fails_the_sample_with_the_reason(tiny_sd3_dir, one_torch_thread):
    _, traj, _ = _step(tiny_sd3_dir)
    traj.log_probs[1, 0] = float("nan")
    traj.latents[2, 1, 0, 0, 0] = float("inf")
    params = SamplingParams(n=4, seed=0, height=32, width=32, num_inference_steps=4)
    reasons = nonfinite_reasons(traj, params, "bfloat16")
    assert [r is not None for r in reasons] == [False, True, True, False, False, False, False, False]
    assert "non-finite log-prob" in reasons[1] and "non-finite latent" in reasons[2]
    assert "actor_rollout_ref.rollout.dtype=bfloat16" in reasons[1]


def test_non_finite_recomputed_log_probs_stop_the_step_loudly(tiny_sd3_dir, one_torch_thread):
    actor, traj, _ = _step(tiny_sd3_dir)
    traj.latents[3, 0] = float("nan")  # as an fp16 overflow on the training side would make them
    with pytest.raises(RuntimeError, match=r"old log-probs of samples \[3\] are not finite.*fsdp_config.dtype"):
        actor.train_on(traj, ADVANTAGES, 2)


def test_rollout_probs_diff_is_the_max_and_mean_absolute_difference():
    rollout = torch.tensor([[0.0, 1.0], [2.0, 3.0]])
    old = torch.tensor([[0.5, 1.0], [2.0, 1.0]])
    assert rollout_probs_diff(rollout, old) == {"training/rollout_probs_diff_max": 2.0, "training/rollout_probs_diff_mean": 0.625}


def test_gen_batch_size_chunks_are_dealt_round_robin_to_the_workers():
    from omni_core.data.prompts import PromptRecord

    params = SamplingParams(n=2, seed=0, height=32, width=32, num_inference_steps=4)
    records = [PromptRecord(prompt=f"p{i}", index=i) for i in range(5)]
    request = RolloutRequest.of_records("run/train", 1, params, records, uid_prefix="000001")
    calls = request.assign(2, chunk_size=2)
    assert [[[it.position for it in c.items] for c in w] for w in calls] == [[[0, 1], [4]], [[2, 3]]]
    # Without a chunk size: one contiguous part per worker (today's split), empty parts make no call.
    assert [[[it.position for it in c.items] for c in w] for w in request.assign(2)] == [[[0, 1]], [[2, 3, 4]]]
    assert request.assign(8)[0] == []


def test_a_bf16_run_completes_through_the_flow_and_logs_its_drift(
    prefect_api, ray_cluster, transfer_queue, flow_overrides, tmp_path
):
    """The whole flow with a bf16 rollout and bf16-autocast training: it completes, every metric of its last
    step is finite, the drift is reported, the validation image reaches the file tracker, and the run's
    placement group is gone afterwards."""
    from omniflow.flows.main_diffusion_v1 import main_diffusion_v1
    from ray.util.state import list_placement_groups

    state = main_diffusion_v1(
        overrides=[
            *flow_overrides,
            "trainer.total_epochs=1",
            f"trainer.default_local_dir={tmp_path / 'ckpt'}",
            "actor_rollout_ref.rollout.dtype=bfloat16",
            "actor_rollout_ref.actor.fsdp_config.dtype=bfloat16",
            "trainer.log_val_generations=1",
        ],
        return_state=True,
    )
    assert state.is_completed(), state.message
    result = state.result()
    metrics = result.final_metrics
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert abs(metrics["actor/ratio_mean"] - 1.0) < RATIO_TOL
    assert metrics["training/rollout_probs_diff_max"] > 0.0
    pngs = sorted((tmp_path / "ckpt" / "logs").rglob("val_generations/*.png"))
    assert len(pngs) == 1, pngs  # log_val_generations=1: one image of the validation before training
    groups = list_placement_groups(address=ray_cluster.get_runtime_context().gcs_address, detail=True)
    assert not [g for g in groups if result.run_id in (g.name or "") and g.state != "REMOVED"]
