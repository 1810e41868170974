"""The stochastic denoising step of Flow-GRPO with its Gaussian log-probability, plus SDE windows.

Follows flow_grpo's ``sde_step_with_logprob`` (yifan123/flow_grpo,
``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``; arXiv 2505.05470 §ODE-to-SDE) -- reimplemented,
not copied. Notation: ``sigma`` is the current noise level (1 = pure
noise), ``sigma_next`` the next one, ``dt = sigma_next - sigma < 0``, ``v`` the predicted velocity,
``a = noise_level``.

``sde`` (Flow-GRPO, Euler-Maruyama of ``dx = [v + s_t^2/(2t)(x + (1-t)v)]dt + s_t dw``):
    std  = a * sqrt(sigma / (1 - sigma'))          sigma' = sigma, except sigma == 1 -> sigma_max
    mean = x * (1 + std^2 / (2 sigma) * dt) + v * (1 + std^2 (1 - sigma) / (2 sigma)) * dt
    x'   = mean + std * sqrt(-dt) * eps
    logp = mean over non-batch dims of  log N(x'; mean, (std * sqrt(-dt))^2)
``cps`` (Coefficients-Preserving Sampling, arXiv 2509.05952):
    std  = sigma_next * sin(a * pi / 2);  x0 = x - sigma v;  x1 = x + (1 - sigma) v
    mean = (1 - sigma_next) x0 + sqrt(sigma_next^2 - std^2) x1;  x' = mean + std * eps
    logp = mean over non-batch dims of  -(x' - mean)^2          (constants dropped, as in flow_grpo)
``dance_sde`` (DanceGRPO, arXiv 2505.07818; verl-omni's ``FlowMatchSDEDiscreteScheduler``): a score-corrected step,
stable at sigma = 1:
    x0   = x - sigma v;  score = -(x - (1 - sigma) x0) / sigma^2
    mean = x + v dt - (a^2 / 2) score dt;  std = a * sqrt(-dt);  x' = mean + std * eps
    logp = mean over non-batch dims of  log N(x'; mean, std^2)

All arithmetic is fp32 whatever the input dtype (bf16 breaks the on-policy ratio == 1). ``noise_level == 0``
is the deterministic Euler step ``x + v dt`` with a zero log-prob (the Gaussian is degenerate there).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from omni_core.sde_defaults import NOISE_LEVEL, SDE_TYPE

SDE_TYPES = ("sde", "cps", "dance_sde")
Generators = torch.Generator | Sequence[torch.Generator] | None


def randn_per_sample(shape: Sequence[int], generator: Generators, device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard normal fp32 noise of ``shape`` (batch first).

    With a list of generators, row ``i`` is drawn from ``generator[i]`` alone, so a sample's noise does not
    depend on which other samples share its batch. Noise is drawn on each generator's device (CPU
    generators give the same numbers on every machine) and then moved to ``device``.
    """
    shape = tuple(shape)
    if generator is None:
        return torch.randn(shape, device=device, dtype=torch.float32)
    if isinstance(generator, torch.Generator):
        return torch.randn(shape, generator=generator, device=generator.device, dtype=torch.float32).to(device)
    if len(generator) != shape[0]:
        raise ValueError(f"got {len(generator)} generators for a batch of {shape[0]}")
    rows = [torch.randn(shape[1:], generator=g, device=g.device, dtype=torch.float32) for g in generator]
    return torch.stack(rows).to(device)


def _per_sample(value: torch.Tensor | float, batch: int, ndim: int, device: torch.device) -> torch.Tensor:
    """A scalar or ``[B]`` value as fp32 ``[B, 1, ..., 1]`` that broadcasts against ``[B, ...]`` latents."""
    t = torch.as_tensor(value, dtype=torch.float32, device=device)
    if t.ndim == 0:
        t = t.expand(batch)
    return t.reshape(batch, *([1] * (ndim - 1)))


def sde_step_from_sigmas(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    sigma_max: torch.Tensor | float,
    noise_level: float,
    prev_sample: torch.Tensor | None = None,
    generator: Generators = None,
    sde_type: str = SDE_TYPE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One reverse-SDE step from ``sample`` (at ``sigma``) to ``sigma_next``; see the module docstring.

    Shapes: ``model_output``, ``sample``, ``prev_sample``: ``[B, ...]``; ``sigma``, ``sigma_next``,
    ``sigma_max``: ``[B]`` or scalars. ``sigma_max`` replaces ``sigma`` in ``1 - sigma`` when ``sigma == 1``
    (flow_grpo passes ``scheduler.sigmas[1]``). With ``prev_sample`` given, that transition is re-scored
    instead of sampling a new one (the gradient flows through the mean only).

    Returns ``(prev_sample [B, ...], log_prob [B], prev_sample_mean [B, ...], std_dev_t [B, 1, ..., 1])``,
    all fp32; ``std_dev_t`` is flow_grpo's per-step std (without the ``sqrt(-dt)`` factor for ``sde``; with it for
    ``dance_sde``, as verl-omni's scheduler returns it).
    """
    if sde_type not in SDE_TYPES:
        raise ValueError(f"sde_type={sde_type!r} is not supported; choose one of {list(SDE_TYPES)}")
    x = sample.float()
    v = model_output.float()
    batch, ndim, device = x.shape[0], x.ndim, x.device
    sigma = _per_sample(sigma, batch, ndim, device)
    sigma_next = _per_sample(sigma_next, batch, ndim, device)
    dt = sigma_next - sigma
    reduce_dims = tuple(range(1, ndim))

    if noise_level == 0:
        # Degenerate Gaussian: the step is the Euler ODE step and the log-prob carries no information.
        mean = x + v * dt
        out = mean if prev_sample is None else prev_sample.float()
        return out, torch.zeros(batch, device=device), mean, torch.zeros_like(sigma)

    if sde_type == "sde":
        sigma_max = _per_sample(sigma_max, batch, ndim, device)
        std_dev_t = noise_level * torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma)))
        mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        scale = std_dev_t * torch.sqrt(-dt)
    elif sde_type == "dance_sde":
        x0 = x - sigma * v
        score = -(x - (1 - sigma) * x0) / sigma**2
        mean = x + v * dt - 0.5 * noise_level**2 * score * dt
        std_dev_t = noise_level * torch.sqrt(-dt)
        scale = std_dev_t
    else:  # cps
        std_dev_t = sigma_next * math.sin(noise_level * math.pi / 2)
        x0 = x - sigma * v
        x1 = x + (1 - sigma) * v
        mean = (1 - sigma_next) * x0 + torch.sqrt(sigma_next**2 - std_dev_t**2) * x1
        scale = std_dev_t

    if prev_sample is None:
        prev_sample = mean + scale * randn_per_sample(x.shape, generator, device)
    prev = prev_sample.detach().float()

    if sde_type in ("sde", "dance_sde"):
        log_prob = -((prev - mean) ** 2) / (2 * scale**2) - torch.log(scale) - 0.5 * math.log(2 * math.pi)
    else:
        log_prob = -((prev - mean) ** 2)
    return prev, log_prob.mean(dim=reduce_dims), mean, std_dev_t


def sde_step_with_logprob(
    scheduler,
    model_output: torch.Tensor,
    timestep: torch.Tensor | float,
    sample: torch.Tensor,
    noise_level: float = NOISE_LEVEL,
    prev_sample: torch.Tensor | None = None,
    generator: Generators = None,
    sde_type: str = SDE_TYPE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """flow_grpo-compatible signature: sigmas looked up from per-sample ``timestep`` in ``scheduler``.

    ``scheduler`` is a ``FlowMatchEulerDiscreteScheduler`` after ``set_timesteps``; ``timestep`` is a scalar
    or ``[B]`` in the scheduler's units (``sigma * num_train_timesteps``). ``sigma_max`` is
    ``scheduler.sigmas[1]`` as in flow_grpo. Returns what ``sde_step_from_sigmas`` returns.
    """
    schedule = scheduler.timesteps.to(torch.float32).cpu()
    sigmas = scheduler.sigmas.to(torch.float32).cpu()
    t = torch.as_tensor(timestep, dtype=torch.float32).detach().cpu().reshape(-1)
    t = t.expand(sample.shape[0]) if t.numel() == 1 else t
    dist = (t[:, None] - schedule[None, :]).abs()
    best, index = dist.min(dim=1)
    unknown = best > 1e-3 * max(1.0, float(schedule.max()))  # tolerate dtype round trips, not other steps
    if unknown.any():
        raise ValueError(f"timestep(s) {t[unknown].tolist()} are not in the scheduler's schedule {schedule.tolist()}")
    return sde_step_from_sigmas(
        model_output,
        sample,
        sigmas[index].to(sample.device),
        sigmas[index + 1].to(sample.device),
        float(sigmas[1]),
        noise_level,
        prev_sample=prev_sample,
        generator=generator,
        sde_type=sde_type,
    )


def window_length(num_steps: int, window_size: int | None) -> int:
    """W, the number of SDE (recorded) steps per sample: ``window_size`` or every step but the last."""
    return num_steps - 1 if window_size is None else window_size


def sample_sde_windows(
    num_steps: int,
    batch: int,
    window_size: int | None,
    window_range: Sequence[int] | None,
    generator: Generators = None,
) -> torch.Tensor:
    """Per-sample window start indices ``[B]`` (long); sample ``b`` uses SDE on steps ``[s_b, s_b + W)``.

    ``window_size=None``: every step but the last (whose ``sigma_next`` is 0), start 0. Otherwise the start
    is uniform over ``[range[0], range[1] - window_size]`` (inclusive), i.e. the window lies in the
    half-open step range ``[range[0], range[1])``; ``window_range=None`` means ``[0, num_steps - 1]``.
    A list of generators draws sample ``b``'s start from ``generator[b]`` (reproducible alone).
    """
    if window_size is None:
        return torch.zeros(batch, dtype=torch.long)
    lo, hi = (0, num_steps - 1) if window_range is None else (int(window_range[0]), int(window_range[1]))
    if not 0 <= lo < hi <= num_steps:
        raise ValueError(f"sde_window_range=({lo}, {hi}) must satisfy 0 <= start < end <= num_steps={num_steps}")
    if not 1 <= window_size <= hi - lo:
        raise ValueError(f"sde_window_size={window_size} must be in [1, {hi - lo}] for sde_window_range=({lo}, {hi})")
    if generator is None or isinstance(generator, torch.Generator):
        return torch.randint(lo, hi - window_size + 1, (batch,), generator=generator)
    if len(generator) != batch:
        raise ValueError(f"got {len(generator)} generators for a batch of {batch}")
    return torch.cat([torch.randint(lo, hi - window_size + 1, (1,), generator=g) for g in generator])
