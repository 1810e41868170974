"""Batched rollout: ``generate`` samples with per-step log-probs (training) or at noise level 0 without
them (validation), as the request's ``SamplingParams`` say (``params.generate_kwargs(step)``).

Follows flow_grpo's ``pipeline_with_logprob`` loop (yifan123/flow_grpo) with its newer SDE windows
(``sde_window_size`` / ``sde_window_range``, as in Flow-GRPO-Fast / MixGRPO): each sample uses the SDE
step inside its own window and the deterministic Euler (ODE) step outside it, and only the window is
recorded. Every sample owns a CPU ``torch.Generator`` seeded with ``derive_sample_seed``; its initial
noise, its window start and its step noise all come from that generator, so a sample reproduced alone
(same four seed numbers) starts from bit-identical latents and follows the same window and noise. With
``init_same_noise`` (DanceGRPO) the initial noise is the prompt group's instead: drawn from a generator seeded with
``derive_sample_seed(seed, step, prompt index, GROUP_NOISE_INDEX)``, the same for every sample of the group however
the group is split among calls; the sample's own generator then gives its window and step noise.

``generate_groups`` runs ``generate`` one prompt group at a time. Batched kernels round differently for
different batch shapes (measured on CPU, torch 2.13 / oneDNN: the tiny SD3 transformer's velocity rows
differ by up to 1.2e-6 between batches of 1-3 samples and batches of 4 or more; a batch of prompts through
the text encoders gives other pooled embeddings than each prompt alone), so a sample's tensors would depend
on which prompts shared its batch. A group always runs as the same ``[n, ...]`` batch, so the rollout
workers give the same trajectories, bit for bit, however a request is split among them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from omni_core.models.policy import FlowPolicy
from omni_core.rollout.trajectory import Trajectory
from omni_core.sde import sample_sde_windows, sde_step_from_sigmas, window_length
from omni_core.sde_defaults import NOISE_LEVEL, SDE_TYPE

_SEED_MASK = (1 << 63) - 1


def derive_sample_seed(base_seed: int, global_step: int, prompt_index: int, sample_index: int) -> int:
    """63-bit seed of one sample: the first 8 bytes (big-endian) of
    ``sha256(f"omniflow-sample-seed-v1:{base_seed}:{global_step}:{prompt_index}:{sample_index}")``,
    masked to 63 bits. Hash-derived, so distinct tuples do not collide the way ``base + i`` schemes do
    (verl-omni #561), and the value does not depend on the batch a sample was generated in."""
    key = f"omniflow-sample-seed-v1:{int(base_seed)}:{int(global_step)}:{int(prompt_index)}:{int(sample_index)}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") & _SEED_MASK


# The sample index in the seed of a prompt group's shared initial noise (init_same_noise): no sample has it.
GROUP_NOISE_INDEX = -1


def _generators(seeds: Sequence[int]) -> list[torch.Generator]:
    return [torch.Generator("cpu").manual_seed(s) for s in seeds]


def _use_cfg(policy: FlowPolicy, guidance_scale: float, true_cfg_scale: float, negative_prompts) -> bool:
    return uses_cfg(policy.arch.architecture, guidance_scale, true_cfg_scale, negative_prompts)


def uses_cfg(architecture: Any, guidance_scale: float, true_cfg_scale: float, negative_prompts) -> bool:
    """Whether a batch of `architecture` (its `ARCHITECTURES` entry) runs classifier-free guidance. The architecture
    says which scale is CFG (SD3: guidance_scale; FLUX, Qwen-Image: true_cfg_scale, while FLUX.1-dev's guidance_scale
    feeds only its guidance embedding) and whether CFG needs negative prompts (FluxPipeline / QwenImagePipeline run
    true CFG only with one; SD3 encodes "" itself)."""
    scale = guidance_scale if architecture.cfg_scale == "guidance_scale" else true_cfg_scale
    return scale > 1.0 and (negative_prompts is not None or not architecture.adapter_cls().needs_negative_prompt)


@torch.no_grad()
def generate(
    policy: FlowPolicy,
    prompts: Sequence[str],
    negative_prompts: Sequence[str] | None = None,
    *,
    n: int,
    seed: int,
    global_step: int,
    prompt_indices: Sequence[int] | None = None,
    height: int,
    width: int,
    num_inference_steps: int,
    guidance_scale: float = 1.0,
    true_cfg_scale: float = 1.0,
    noise_level: float = NOISE_LEVEL,
    sde_type: str = SDE_TYPE,
    sde_window_size: int | None = None,
    sde_window_range: Sequence[int] | None = None,
    max_sequence_length: int = 128,
    calculate_log_probs: bool = True,
    first_sample_index: int = 0,
    init_same_noise: bool = False,
) -> Trajectory:
    """Generate ``n`` samples per prompt (B = len(prompts) * n, grouped prompt by prompt).

    ``prompt_indices`` (default ``0..P-1``) are the prompts' dataset indices used in the seeds and stored
    as the group id; samples get ``sample_index`` ``first_sample_index .. first_sample_index + n - 1``
    (a group may be split across calls). Returns the SDE window of every sample (see ``Trajectory``).
    """
    # 1. Check inputs
    prompts = list(prompts)
    if prompt_indices is None:
        prompt_indices = list(range(len(prompts)))
    if len(prompt_indices) != len(prompts):
        raise ValueError(f"{len(prompt_indices)} prompt_indices for {len(prompts)} prompts")
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    device = policy.device

    # 2. One generator per sample, seeded from (seed, step, prompt index, sample index)
    prompt_index = torch.tensor(prompt_indices, dtype=torch.long).repeat_interleave(n)
    sample_index = torch.arange(first_sample_index, first_sample_index + n).repeat(len(prompts))
    seeds = [derive_sample_seed(seed, global_step, int(p), int(s)) for p, s in zip(prompt_index, sample_index, strict=True)]
    gens = _generators(seeds)
    batch = len(seeds)

    # 3. Encode the prompts (and negative prompts with CFG), one row per sample
    do_cfg = _use_cfg(policy, guidance_scale, true_cfg_scale, negative_prompts)
    negs = list(negative_prompts) if negative_prompts is not None else None
    cond = policy.encode_prompts(prompts, negs, max_sequence_length, do_cfg)
    cond = {k: v.repeat_interleave(n, dim=0) for k, v in cond.items()}

    # 4. Initial noise, then each sample's window start (draw order per generator: noise, window, steps; with
    #    init_same_noise the noise comes from the group's generator, and the sample's draws its window and steps)
    if init_same_noise:
        group_seeds = [derive_sample_seed(seed, global_step, int(p), GROUP_NOISE_INDEX) for p in prompt_index]
        latents = policy.prepare_latents(batch, height, width, _generators(group_seeds))
    else:
        latents = policy.prepare_latents(batch, height, width, gens)
    num_window = window_length(num_inference_steps, sde_window_size)
    start = sample_sde_windows(num_inference_steps, batch, sde_window_size, sde_window_range, gens).to(device)

    # 5. Timesteps and sigmas of the schedule
    timesteps, sigmas = policy.set_timesteps(num_inference_steps, height, width)
    timesteps, sigmas = timesteps.to(device), sigmas.to(device)
    sigma_max = sigmas[1]

    # 6. Denoising loop: the SDE step inside each sample's window (recorded), the Euler ODE step outside
    rec_latents = torch.zeros(batch, num_window + 1, *latents.shape[1:], device=device)
    rec_log_probs = torch.full((batch, num_window), float("nan"), device=device)
    rec_timesteps = torch.zeros(batch, num_window, device=device)
    rec_sigmas = torch.zeros(batch, num_window + 1, device=device)
    rows = torch.arange(batch, device=device)

    # With init_same_noise every sample of a group starts from the same latents and conditioning, so until the group's
    # earliest SDE window step all its rows are one ODE path: computed once per group (flow_grpo's Fast sampler).
    group_start = start.view(-1, n).min(dim=1).values if init_same_noise and n > 1 else None

    def velocity(i: int) -> torch.Tensor:
        def forward(picked: torch.Tensor | None) -> torch.Tensor:
            x = latents if picked is None else latents[picked]
            c = cond if picked is None else {k: v[picked] for k, v in cond.items()}
            return policy.velocity(
                x, timesteps[i].expand(x.shape[0]), c, guidance_scale, height=height, width=width, true_cfg_scale=true_cfg_scale
            )

        shared = group_start > i if group_start is not None else None
        if shared is None or not bool(shared.any()):
            return forward(None)
        # One row per group still on its shared path, every row of the others; then each shared row copied n times.
        in_prefix = shared.repeat_interleave(n)
        leaders = (torch.arange(len(shared), device=device) * n)[shared]
        out = forward(torch.cat([leaders, rows[~in_prefix]]))
        v = torch.empty((batch, *out.shape[1:]), dtype=out.dtype, device=out.device)
        v[in_prefix] = out[: len(leaders)].repeat_interleave(n, dim=0)
        v[~in_prefix] = out[len(leaders) :]
        return v

    for i in range(num_inference_steps):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        first = start == i
        rec_latents[first, 0] = latents[first]
        rec_sigmas[first, 0] = sigma

        v = velocity(i)
        # Every sample draws its step noise (used or not) so its random stream is independent of its window.
        sde_next, log_prob, _, _ = sde_step_from_sigmas(
            v,
            latents,
            sigma.expand(batch),
            sigma_next.expand(batch),
            sigma_max,
            noise_level,
            generator=gens,
            sde_type=sde_type,
        )
        ode_next = latents + v * (sigma_next - sigma)
        in_window = (start <= i) & (i < start + num_window)
        mask = in_window.reshape(batch, *([1] * (latents.ndim - 1)))
        latents = torch.where(mask, sde_next, ode_next)

        k = (i - start)[in_window]
        r = rows[in_window]
        rec_latents[r, k + 1] = latents[r]
        rec_timesteps[r, k] = timesteps[i]
        rec_sigmas[r, k + 1] = sigma_next
        if calculate_log_probs:
            rec_log_probs[r, k] = log_prob[r]

    # 7. Decode the final latents to uint8 images
    images = policy.decode(latents, height, width)
    return Trajectory(
        latents=rec_latents,
        log_probs=rec_log_probs,
        timesteps=rec_timesteps,
        sigmas=rec_sigmas,
        sigma_max=sigma_max.expand(batch).clone(),
        window_start=start,
        cond=cond,
        images=images,
        prompts=[p for p in prompts for _ in range(n)],
        sample_seeds=torch.tensor(seeds, dtype=torch.long),
        prompt_index=prompt_index,
        sample_index=sample_index,
    )


def generate_groups(
    policy: FlowPolicy,
    prompts: Sequence[str],
    negative_prompts: Sequence[str] | None = None,
    *,
    prompt_indices: Sequence[int] | None = None,
    **kwargs,
) -> Trajectory:
    """``generate`` for each prompt alone (a batch of its ``n`` samples), concatenated in prompt order.

    Same arguments and result layout as ``generate``; every sample is computed in a batch of exactly ``n``
    rows at the same row, so its latents, log-probs and image do not depend on the other prompts of the
    call (how a request was split across rollout workers or ``data.gen_batch_size`` chunks).
    """
    prompts = list(prompts)
    indices = list(range(len(prompts))) if prompt_indices is None else list(prompt_indices)
    if len(indices) != len(prompts):
        raise ValueError(f"{len(indices)} prompt_indices for {len(prompts)} prompts")
    if not prompts:
        raise ValueError("generate_groups needs at least one prompt")
    negs = list(negative_prompts) if negative_prompts is not None else None
    if negs is not None and len(negs) != len(prompts):
        raise ValueError(f"{len(negs)} negative prompts for {len(prompts)} prompts")
    groups = [
        generate(policy, [prompt], None if negs is None else [negs[i]], prompt_indices=[indices[i]], **kwargs)
        for i, prompt in enumerate(prompts)
    ]
    return groups[0] if len(groups) == 1 else Trajectory.cat(groups)


class TransitionScore(NamedTuple):
    """One window step re-scored by ``score_transitions`` (the velocity is kept for a KL on the velocity)."""

    log_prob: torch.Tensor
    prev_sample_mean: torch.Tensor
    std_dev_t: torch.Tensor
    velocity: torch.Tensor


def score_transitions(
    policy: FlowPolicy,
    traj: Trajectory,
    step: int,
    *,
    guidance_scale: float,
    noise_level: float,
    sde_type: str = SDE_TYPE,
    use_reference: bool = False,
    detach_uncond: bool = False,
    true_cfg_scale: float = 1.0,
    use_teacher: bool = False,
) -> TransitionScore:
    """Re-score window step ``step`` of every sample under the current (or reference) policy.

    Returns ``(log_prob [B], prev_sample_mean [B, *S], std_dev_t [B, 1, ...], velocity [B, *S])``; gradients
    flow through the policy's velocity unless ``use_reference`` or ``use_teacher`` (the distillation teacher's,
    `FlowPolicy.load_teacher`) (``detach_uncond``: not through CFG's
    unconditional branch). With unchanged weights and the same batch, the log-prob equals the rollout's bit
    for bit (ratio exactly 1 in fp32).
    """
    (scored,) = score_window_steps(
        policy,
        traj,
        [step],
        guidance_scale=guidance_scale,
        noise_level=noise_level,
        sde_type=sde_type,
        use_reference=use_reference,
        detach_uncond=detach_uncond,
        true_cfg_scale=true_cfg_scale,
        use_teacher=use_teacher,
    )
    return scored


def score_window_steps(
    policy: FlowPolicy,
    traj: Trajectory,
    steps: Sequence[int],
    *,
    guidance_scale: float,
    noise_level: float,
    sde_type: str = SDE_TYPE,
    use_reference: bool = False,
    detach_uncond: bool = False,
    true_cfg_scale: float = 1.0,
    use_teacher: bool = False,
) -> list[TransitionScore]:
    """``score_transitions`` of several window ``steps`` in one transformer forward: the samples' rows of each step
    stacked (``[len(steps) * B, ...]``, step by step, the conditioning repeated), then split per step. The same numbers
    as one forward per step up to fp32 rounding (a batched matmul may sum in another order); one step is exactly
    ``score_transitions``. Trades activation memory (``len(steps)`` x) for fewer, larger kernels."""
    device = policy.device
    height, width = traj.images.shape[-2:]
    many = len(steps) > 1

    def rows(values: torch.Tensor, offset: int = 0) -> torch.Tensor:
        picked = [values[:, j + offset] for j in steps]
        return (torch.cat(picked) if many else picked[0]).to(device)

    cond = {k: torch.cat([v] * len(steps)) for k, v in traj.cond.items()} if many else traj.cond
    latents = rows(traj.latents)
    v = policy.velocity(
        latents,
        rows(traj.timesteps),
        cond,
        guidance_scale,
        use_reference=use_reference,
        height=height,
        width=width,
        detach_uncond=detach_uncond,
        true_cfg_scale=true_cfg_scale,
        use_teacher=use_teacher,
    )
    sigma_max = traj.sigma_max.repeat(len(steps)) if many else traj.sigma_max
    _, log_prob, mean, std = sde_step_from_sigmas(
        v,
        latents,
        rows(traj.sigmas),
        rows(traj.sigmas, 1),
        sigma_max.to(device),
        noise_level,
        prev_sample=rows(traj.latents, 1),
        sde_type=sde_type,
    )
    if not many:
        return [TransitionScore(log_prob, mean, std, v)]
    n = len(steps)
    std_parts = std.chunk(n) if isinstance(std, torch.Tensor) and std.ndim and std.shape[0] == n * traj.batch_size else [std] * n
    return [TransitionScore(*parts) for parts in zip(log_prob.chunk(n), mean.chunk(n), std_parts, v.chunk(n), strict=True)]
