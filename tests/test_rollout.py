"""Rollout: per-sample SDE windows, on-policy ratio == 1, per-sample reproducibility, Trajectory rows."""

from __future__ import annotations

import hashlib

import pytest
import torch

from omni_core.models.policy import FlowPolicy
from omni_core.rollout.sampler import derive_sample_seed, generate, score_transitions
from omni_core.rollout.trajectory import Trajectory

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SIZE, STEPS, MAX_LEN = 64, 4, 16
PROMPTS = ["a red circle", "two blue squares"]


@pytest.fixture(scope="module")
def sd3_policy(tiny_sd3_dir):
    return FlowPolicy(tiny_sd3_dir)


@pytest.fixture(scope="module")
def flux_policy(tiny_flux_dir):
    return FlowPolicy(tiny_flux_dir, lora_rank=4, target_modules=["to_q", "to_k", "to_v"])


def _generate(policy, prompts=PROMPTS, **overrides):
    kwargs = dict(
        n=2,
        seed=7,
        global_step=3,
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        guidance_scale=1.0,
        noise_level=0.7,
        sde_window_size=2,
        sde_window_range=(0, 3),
        max_sequence_length=MAX_LEN,
    )
    return generate(policy, prompts, **(kwargs | overrides))


def test_derive_sample_seed_is_the_documented_formula():
    digest = hashlib.sha256(b"omniflow-sample-seed-v1:7:3:1:0").digest()
    assert derive_sample_seed(7, 3, 1, 0) == int.from_bytes(digest[:8], "big") & (2**63 - 1)
    seeds = {derive_sample_seed(0, s, p, i) for s in range(4) for p in range(8) for i in range(8)}
    assert len(seeds) == 256 and all(0 <= s < 2**63 for s in seeds)


@pytest.mark.parametrize("policy_name", ["sd3_policy", "flux_policy"])
def test_window_shapes_and_per_sample_bookkeeping(policy_name, request):
    policy = request.getfixturevalue(policy_name)
    traj = _generate(policy)
    b, w, shape = 4, 2, policy.latent_shape(SIZE, SIZE)
    assert traj.latents.shape == (b, w + 1, *shape) and traj.latents.dtype == torch.float32
    assert traj.log_probs.shape == traj.timesteps.shape == (b, w) and torch.isfinite(traj.log_probs).all()
    assert traj.sigmas.shape == (b, w + 1) and traj.images.shape == (b, 3, SIZE, SIZE)
    assert traj.images.dtype == torch.uint8
    assert traj.prompts == [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2
    assert traj.prompt_index.tolist() == [0, 0, 1, 1] and traj.sample_index.tolist() == [0, 1, 0, 1]
    assert all(v.shape[0] == b and v.dtype == torch.float32 for v in traj.cond.values())

    timesteps, sigmas = policy.set_timesteps(STEPS, SIZE, SIZE)
    for row in range(b):
        s = int(traj.window_start[row])
        assert 0 <= s <= 1  # start uniform in [range[0], range[1] - size] = [0, 1]
        assert torch.equal(traj.timesteps[row], timesteps[s : s + w])
        assert torch.equal(traj.sigmas[row], sigmas[s : s + w + 1])


@pytest.mark.parametrize(
    "policy_name,guidance,sde_type",
    [("sd3_policy", 3.0, "sde"), ("sd3_policy", 1.0, "cps"), ("sd3_policy", 1.0, "dance_sde"), ("flux_policy", 3.5, "sde")],
)
def test_rescoring_with_unchanged_weights_gives_ratio_exactly_one(policy_name, guidance, sde_type, request):
    policy = request.getfixturevalue(policy_name)
    traj = _generate(policy, guidance_scale=guidance, sde_type=sde_type, negative_prompts=["blurry"] * 2)
    if policy_name == "sd3_policy" and guidance > 1:
        assert "negative_prompt_embeds" in traj.cond  # the CFG path is the one re-scored
    # Through the TransferQueue row schema and back, as the training actor receives it.
    traj = Trajectory.from_columns(traj.to_columns())
    for j in range(traj.window_size):
        log_prob = score_transitions(policy, traj, j, guidance_scale=guidance, noise_level=0.7, sde_type=sde_type).log_prob
        ratio = torch.exp(log_prob - traj.log_probs[:, j])
        assert torch.equal(ratio, torch.ones_like(ratio)), f"step {j}: ratio {ratio.tolist()}"
        assert log_prob.requires_grad  # the re-scored log-prob is differentiable through the policy


@pytest.mark.parametrize("policy_name", ["sd3_policy", "flux_policy"])
def test_a_sample_regenerated_alone_equals_the_same_sample_in_a_batch(policy_name, request):
    policy = request.getfixturevalue(policy_name)
    batch = _generate(policy)
    alone = _generate(policy, prompts=[PROMPTS[1]], prompt_indices=[1], n=1, first_sample_index=1)
    row = 3  # prompt 1, sample 1
    assert alone.sample_seeds[0] == batch.sample_seeds[row]
    assert alone.window_start[0] == batch.window_start[row]
    assert torch.equal(alone.timesteps[0], batch.timesteps[row])
    # The initial noise is bit-identical; the denoised values may differ by float rounding of batched matmuls.
    alone_noise = policy.prepare_latents(1, SIZE, SIZE, [torch.Generator().manual_seed(int(alone.sample_seeds[0]))])
    assert torch.equal(
        alone_noise[0], policy.prepare_latents(1, SIZE, SIZE, [torch.Generator().manual_seed(int(batch.sample_seeds[row]))])[0]
    )
    torch.testing.assert_close(alone.latents[0], batch.latents[row], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(alone.log_probs[0], batch.log_probs[row], rtol=1e-4, atol=1e-4)
    assert (alone.images[0].int() - batch.images[row].int()).abs().max() <= 1


def test_full_schedule_window_from_pure_noise(sd3_policy):
    traj = _generate(sd3_policy, prompts=PROMPTS[:1], n=2, sde_window_size=None, sde_window_range=None)
    assert traj.window_size == STEPS - 1 and traj.window_start.tolist() == [0, 0]
    init = sd3_policy.prepare_latents(2, SIZE, SIZE, [torch.Generator().manual_seed(int(s)) for s in traj.sample_seeds])
    assert torch.equal(traj.latents[:, 0], init)  # the window starts at sigma = 1 with the initial noise
    assert torch.isfinite(traj.log_probs).all()


def test_trajectory_columns_and_batches_round_trip(sd3_policy):
    traj = _generate(sd3_policy, n=2)
    columns = traj.to_columns()
    assert columns["latents"].shape == traj.latents.shape and "cond.prompt_embeds" in columns
    assert set(traj.to_columns(window=False)) == {"images", "sample_seeds", "prompt_index", "sample_index"}
    # Rows arrive in any order from the queue; reassemble, sort by (prompt_index, sample_index).
    arrival = torch.tensor([3, 0, 2, 1])
    shuffled = Trajectory.from_columns({k: v[arrival] for k, v in columns.items()})
    order = torch.argsort(shuffled.prompt_index * 10 + shuffled.sample_index)
    restored = Trajectory.cat([shuffled.index_select(order[:2]), shuffled.index_select(order[2:])])
    for name in ("latents", "log_probs", "timesteps", "sigmas", "sigma_max", "window_start", "images", "sample_seeds"):
        assert torch.equal(getattr(restored, name), getattr(traj, name)), name
    assert all(torch.equal(restored.cond[k], traj.cond[k]) for k in traj.cond)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        Trajectory(**{**vars(traj), "timesteps": traj.timesteps[:, :1]})


# ----------------------------------------------------------------------------- MixGRPO's window schedule
def _mix_params(strategy: str, **algo):
    from omni_core.config import load_config
    from omni_core.rollout.sampling_params import SamplingParams

    overrides = [
        "actor_rollout_ref.model.algorithm=mix_grpo",
        f"actor_rollout_ref.rollout.algo.sample_strategy={strategy}",
        "actor_rollout_ref.rollout.algo.sde_window_size=2",
        "actor_rollout_ref.rollout.algo.sde_window_range=[0,5]",
        "actor_rollout_ref.rollout.pipeline.num_inference_steps=6",
        "actor_rollout_ref.rollout.pipeline.height=32",
        "actor_rollout_ref.rollout.pipeline.width=32",
        "actor_rollout_ref.rollout.n=2",
        *(f"actor_rollout_ref.rollout.algo.{k}={v}" for k, v in algo.items()),
    ]
    arr = load_config(overrides=overrides).actor_rollout_ref
    return SamplingParams.for_training(arr.rollout, arr.model.algorithm)


def test_mixgrpo_random_windows_are_one_per_step_and_the_same_on_two_workers(sd3_policy):
    """Two workers sampling different prompts of the same step (different sample seeds) get the same window, whose
    start is verl-omni's draw: Python's random.Random(sde_window_seed + step).randint(lo, hi - size)."""
    import random

    params = _mix_params("random", sde_window_seed=42)
    for step in (1, 2, 3):
        expected = random.Random(42 + step).randint(0, 5 - 2)
        worker_a = generate(sd3_policy, ["a red circle"], prompt_indices=[0], **params.generate_kwargs(step))
        worker_b = generate(sd3_policy, ["two blue squares"], prompt_indices=[1], **params.generate_kwargs(step))
        assert worker_a.window_start.tolist() == worker_b.window_start.tolist() == [expected, expected]
    # Without MixGRPO each sample draws its own window from its seed: these differ inside one batch.
    flow_grpo = params.replace(mix_window=None)
    starts = generate(sd3_policy, PROMPTS * 4, prompt_indices=range(8), **flow_grpo.generate_kwargs(1)).window_start
    assert len(set(starts.tolist())) > 1


def test_mixgrpo_progressive_windows_slide_by_their_size_every_iters_per_group_steps():
    """Hand table for sde_window_size=2 in [0, 5) with iters_per_group=2: start = min(0 + (step // 2) * 2, 3)."""
    params = _mix_params("progressive", iters_per_group=2)
    starts = [params.generate_kwargs(step)["sde_window_range"] for step in range(1, 8)]
    assert starts == [(0, 2), (2, 4), (2, 4), (3, 5), (3, 5), (3, 5), (3, 5)]


def test_init_same_noise_starts_every_sample_of_a_group_from_the_groups_noise(sd3_policy):
    """DanceGRPO's init_same_noise: the samples of a prompt group start from one initial noise, drawn from the seed
    derive_sample_seed(seed, step, prompt index, -1) whichever call samples them; the SDE noise still tells them
    apart. Without it each sample starts from its own seed's noise."""
    full = dict(sde_window_size=None, sde_window_range=None)  # the window starts at sigma = 1: latents[:, 0] is the noise
    same = _generate(sd3_policy, n=3, init_same_noise=True, **full)
    group_seeds = [derive_sample_seed(7, 3, p, -1) for p in (0, 1)]
    expected = sd3_policy.prepare_latents(
        6, SIZE, SIZE, [torch.Generator().manual_seed(s) for s in group_seeds for _ in range(3)]
    )
    assert torch.equal(same.latents[:, 0], expected)
    assert not torch.equal(same.latents[0, 0], same.latents[3, 0])  # two groups, two noises
    assert not torch.equal(same.latents[0, -1], same.latents[1, -1])  # the SDE steps differ within the group
    # A group split between calls (its third sample alone) starts from the same noise.
    alone = _generate(
        sd3_policy, prompts=[PROMPTS[1]], prompt_indices=[1], n=1, first_sample_index=2, init_same_noise=True, **full
    )
    assert torch.equal(alone.latents[0, 0], same.latents[5, 0])
    own = _generate(sd3_policy, n=3, **full)
    assert not torch.equal(own.latents[0, 0], own.latents[1, 0])


def test_a_groups_shared_ode_prefix_is_computed_once_and_equals_per_sample_ode_steps(sd3_policy):
    """With init_same_noise every sample of a group starts from the group's noise, so until the group's earliest SDE
    window step its samples follow one ODE path: the sampler computes it for one row per group (flow_grpo's Fast
    sampler). Checked against plain Euler steps of every sample from the same noise, written here, and by counting
    the rows the transformer saw (a forward hook on the module)."""
    steps, n = 6, 4
    rows_seen: list[int] = []
    hook = sd3_policy.transformer.register_forward_hook(
        lambda module, args, kwargs, out: rows_seen.append((args[0] if args else kwargs["hidden_states"]).shape[0]), with_kwargs=True
    )
    try:
        traj = _generate(sd3_policy, n=n, num_inference_steps=steps, sde_window_size=2, sde_window_range=(2, 5), init_same_noise=True)
    finally:
        hook.remove()
    starts = traj.window_start.view(2, n)
    group_start = starts.min(dim=1).values
    assert bool((group_start >= 2).all())
    # Rows the transformer computed: one per group while the group is on its shared path, all n afterwards.
    expected_rows = [sum(1 if int(g) > i else n for g in group_start) for i in range(steps)]
    assert rows_seen == expected_rows and sum(rows_seen) < steps * 2 * n
    # Plain Euler steps of all 2 x n samples from the group noise, up to each group's earliest window.
    group_seeds = [derive_sample_seed(7, 3, p, -1) for p in (0, 1)]
    x = sd3_policy.prepare_latents(2 * n, SIZE, SIZE, [torch.Generator().manual_seed(s) for s in group_seeds for _ in range(n)])
    timesteps, sigmas = sd3_policy.set_timesteps(steps, SIZE, SIZE)
    cond = {k: v.repeat_interleave(n, dim=0) for k, v in sd3_policy.encode_prompts(PROMPTS, None, MAX_LEN, False).items()}
    entered = {}
    with torch.no_grad():
        for i in range(int(group_start.max())):
            for r in range(2 * n):
                if int(traj.window_start[r]) == i:
                    entered[r] = x[r].clone()
            v = sd3_policy.velocity(x, timesteps[i].expand(2 * n), cond, 1.0, height=SIZE, width=SIZE)
            x = x + v * (sigmas[i + 1] - sigmas[i])
        for r in range(2 * n):
            if int(traj.window_start[r]) == int(group_start.max()):
                entered[r] = x[r].clone()
    leaders = [r for r in range(2 * n) if int(traj.window_start[r]) == int(group_start[r // n])]
    assert leaders and set(leaders) <= set(entered)
    for r in leaders:  # each group's first window step starts from the shared path's latents
        torch.testing.assert_close(traj.latents[r, 0], entered[r], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("algo", "expected"),
    [
        ({}, False),
        ({"sde_type": "dance_sde"}, True),
        ({"sde_type": "dance_sde", "init_same_noise": False}, False),
        ({"init_same_noise": True}, True),
    ],
)
def test_init_same_noise_is_on_for_dance_sde_unless_set(algo, expected):
    from omni_core.config import load_config
    from omni_core.rollout.sampling_params import SamplingParams

    overrides = [f"actor_rollout_ref.rollout.algo.{k}={str(v).lower()}" for k, v in algo.items()]
    rollout = load_config(overrides=overrides).actor_rollout_ref.rollout
    assert SamplingParams.for_training(rollout).init_same_noise is expected
    assert SamplingParams.for_validation(rollout).init_same_noise is False  # validation keeps each sample's own noise
