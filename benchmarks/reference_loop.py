"""A hand-written Flow-GRPO training loop in plain torch + diffusers + PIL: the independent baseline.

Written from the Flow-GRPO paper's equations (arXiv 2505.05470, ODE-to-SDE conversion and the GRPO
objective) in the flow_grpo style (yifan123/flow_grpo ``scripts/train_sd3_fast.py``: one SDE window per
batch, rollout log-probs as the old log-probs), readable top to bottom as CleanRL's ``ppo.py``. It imports no
OmniFlow code (only the shared default noise level, a plain constant), so ``benchmarks/bench_core.py`` can compare
omni_core's plain loop against it at equal work: same model folder, shapes, number of transformer calls, trained
transitions, threads, fp32.

One training step:
    1. encode P prompts (``pipe.encode_prompt``), n samples each -> B = P x n
    2. rollout: T denoising steps; steps [s, s + W) take the SDE step and record (x_t, x_t', log p),
       the others the Euler ODE step; s is drawn uniformly so the window lies in ``window_range``
    3. decode to uint8 images; reward = jpeg_compressibility = -(JPEG bytes at q=95 / 1000) / 500
    4. GRPO advantages: (R - group mean) / (std over the whole batch + 1e-4), clamped to +-5
    5. update: per mini-batch, per micro-batch, per window step j: transformer forward, transition mean,
       log-prob, ratio to the rollout's log-prob, clipped loss, ``backward`` at once; then grad clip and AdamW

The SDE step (paper Eq. 12, Euler-Maruyama with dt = sigma_next - sigma < 0 and noise level a):
    sigma_t = a * sqrt(t / (1 - t))                 (t = 1 is replaced by the schedule's second sigma)
    mean    = x + [v + sigma_t^2 / (2 t) * (x + (1 - t) v)] * dt
    x'      = mean + sigma_t * sqrt(-dt) * eps
    log p   = mean over latent dims of log N(x'; mean, (sigma_t sqrt(-dt))^2)

    python benchmarks/reference_loop.py --model-path models/tiny-sd3 --steps 5
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from diffusers import StableDiffusion3Pipeline
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift
from diffusers.utils import logging as diffusers_logging
from PIL import Image

from omni_core.sde_defaults import NOISE_LEVEL

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS_FILE = REPO / "omni_core" / "assets" / "prompts" / "train.txt"  # read as text, not imported


@dataclass
class ReferenceConfig:
    """Every knob of the loop; the defaults are OmniFlow's (omni_core/config/defaults.yaml)."""

    model_path: str
    prompts: list[str]
    prompts_per_step: int = 2  # data.train_batch_size
    n: int = 8  # actor_rollout_ref.rollout.n (group size)
    height: int = 64
    width: int = 64
    num_steps: int = 10
    noise_level: float = NOISE_LEVEL
    window_size: int = 2
    window_range: tuple[int, int] = (0, 5)
    max_sequence_length: int = 32
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    clip_ratio: float = 1e-4
    adv_clip_max: float = 5.0
    mini_batch_prompts: int = 2  # actor.ppo_mini_batch_size: a mini-batch holds this many groups
    micro_batch: int = 8
    seed: int = 42
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    device: str = "cpu"


# ---------------------------------------------------------------------------------------- SDE step
def sde_transition(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    sigma_max: float,
    noise_level: float,
    prev_sample: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One reverse-SDE step from ``x`` at ``sigma`` to ``sigma_next`` (module docstring), all in fp32.

    ``sigma`` / ``sigma_next``: scalars or ``[B]``. Samples ``x' = mean + scale * noise`` unless
    ``prev_sample`` is given (then that transition is scored). Returns ``(x' [B, ...], log_prob [B],
    mean [B, ...], sigma_t [B, 1, 1, 1])``.
    """
    v, x = v.float(), x.float()
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    t = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(x.shape[0]).reshape(shape)
    t_next = torch.as_tensor(sigma_next, dtype=torch.float32, device=x.device).expand(x.shape[0]).reshape(shape)
    dt = t_next - t
    one_minus_t = 1 - torch.where(t == 1, torch.full_like(t, sigma_max), t)  # sigma_t is infinite at t = 1
    sigma_t = noise_level * torch.sqrt(t / one_minus_t)
    mean = x + (v + sigma_t**2 / (2 * t) * (x + (1 - t) * v)) * dt
    scale = sigma_t * torch.sqrt(-dt)
    if prev_sample is None:
        prev_sample = mean + scale * noise
    prev = prev_sample.detach().float()
    log_density = -((prev - mean) ** 2) / (2 * scale**2) - torch.log(scale) - 0.5 * math.log(2 * math.pi)
    return prev, log_density.mean(dim=tuple(range(1, x.ndim))), mean, sigma_t


# ---------------------------------------------------------------------------------------- model calls
def velocity(pipe: StableDiffusion3Pipeline, x: torch.Tensor, t: torch.Tensor, embeds: torch.Tensor, pooled: torch.Tensor):
    """The SD3 transformer's prediction ``v(x, t)`` for timesteps ``t [B]`` in scheduler units (0..1000)."""
    return pipe.transformer(
        hidden_states=x, timestep=t, encoder_hidden_states=embeds, pooled_projections=pooled, return_dict=False
    )[0].float()


def schedule(pipe: StableDiffusion3Pipeline, num_steps: int, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``timesteps [T]`` and ``sigmas [T + 1]`` (last 0) as the SD3 pipeline sets them (shifted schedule; with
    dynamic shifting, SD3.5-style configs, the shift follows the image's token count)."""
    kwargs = {}
    config = pipe.scheduler.config
    if config.get("use_dynamic_shifting", False):
        patch, f = pipe.transformer.config.patch_size, pipe.vae_scale_factor
        tokens = (height // f // patch) * (width // f // patch)
        kwargs["mu"] = calculate_shift(
            tokens,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
    pipe.scheduler.set_timesteps(num_steps, device="cpu", **kwargs)
    return pipe.scheduler.timesteps.float(), pipe.scheduler.sigmas.float()


@torch.no_grad()
def decode(pipe: StableDiffusion3Pipeline, latents: torch.Tensor) -> torch.Tensor:
    """Latents -> uint8 images ``[B, 3, H, W]``."""
    vae = pipe.vae
    z = latents / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
    image = vae.decode(z, return_dict=False)[0].float()
    return ((image / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)


def jpeg_compressibility(images: torch.Tensor) -> torch.Tensor:
    """``-kB / 500`` of each image saved as JPEG at quality 95 (kB = 1000 bytes): smaller files score higher."""
    scores = []
    for image in images.cpu():
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(image.permute(1, 2, 0).numpy())).save(buffer, format="JPEG", quality=95)
        scores.append(-buffer.tell() / 1000 / 500)
    return torch.tensor(scores, dtype=torch.float32)


def grpo_advantages(rewards: torch.Tensor, n: int, eps: float = 1e-4) -> torch.Tensor:
    """``(R_i - mean of its group) / (std over the batch + eps)``; groups are consecutive runs of ``n``."""
    grouped = rewards.float().reshape(-1, n)
    centered = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    if n == 1:  # a group of one has no baseline
        return torch.zeros_like(centered)
    return centered / (rewards.float().std() + eps)


# ---------------------------------------------------------------------------------------- rollout
@torch.no_grad()
def rollout(pipe: StableDiffusion3Pipeline, prompts: list[str], cfg: ReferenceConfig, gen: torch.Generator) -> dict:
    """Sample ``n`` images per prompt; record the SDE window: latents ``[B, W + 1, C, h, w]``, log-probs,
    timesteps and sigmas ``[W]`` / ``[W + 1]`` (one window for the whole batch, as flow_grpo's fast mode)."""
    device, n, W = torch.device(cfg.device), cfg.n, cfg.window_size
    embeds, _, pooled, _ = pipe.encode_prompt(
        prompt=prompts,
        prompt_2=None,
        prompt_3=None,
        device=device,
        num_images_per_prompt=n,
        do_classifier_free_guidance=False,
        max_sequence_length=cfg.max_sequence_length,
    )
    B = len(prompts) * n
    f = pipe.vae_scale_factor
    x = torch.randn(B, pipe.transformer.config.in_channels, cfg.height // f, cfg.width // f, generator=gen).to(device)
    timesteps, sigmas = schedule(pipe, cfg.num_steps, cfg.height, cfg.width)
    lo, hi = cfg.window_range
    start = int(torch.randint(lo, hi - W + 1, (1,), generator=gen))

    latents, log_probs = [], []
    for i in range(cfg.num_steps):
        v = velocity(pipe, x, timesteps[i].expand(B).to(device), embeds, pooled)
        if start <= i < start + W:
            if i == start:
                latents.append(x)
            noise = torch.randn(x.shape, generator=gen).to(device)
            x, log_prob, _, _ = sde_transition(v, x, sigmas[i], sigmas[i + 1], float(sigmas[1]), cfg.noise_level, noise=noise)
            latents.append(x)
            log_probs.append(log_prob)
        else:
            x = x + v * (sigmas[i + 1] - sigmas[i])  # Euler ODE step
    return {
        "latents": torch.stack(latents, dim=1),
        "log_probs": torch.stack(log_probs, dim=1),
        "timesteps": timesteps[start : start + W],
        "sigmas": sigmas[start : start + W + 1],
        "sigma_max": float(sigmas[1]),
        "embeds": embeds,
        "pooled": pooled,
        "images": decode(pipe, x),
        "window_start": start,
    }


# ---------------------------------------------------------------------------------------- update
def update(pipe: StableDiffusion3Pipeline, optimizer: torch.optim.Optimizer, traj: dict, adv: torch.Tensor, cfg: ReferenceConfig):
    """One pass over the batch: an AdamW step per mini-batch, a ``backward`` per (micro-batch, window step)."""
    device, W = torch.device(cfg.device), cfg.window_size
    B = adv.shape[0]
    mini = cfg.mini_batch_prompts * cfg.n
    n_micro = math.ceil(mini / cfg.micro_batch)
    adv = adv.clamp(-cfg.adv_clip_max, cfg.adv_clip_max).to(device)
    params = [p for p in pipe.transformer.parameters() if p.requires_grad]
    ratios, losses, clipped, grad_norms = [], [], [], []
    pipe.transformer.train()
    for m0 in range(0, B, mini):
        for b0 in range(m0, m0 + mini, cfg.micro_batch):
            rows = slice(b0, min(b0 + cfg.micro_batch, m0 + mini))
            for j in range(W):
                x = traj["latents"][rows, j]
                t = traj["timesteps"][j].expand(x.shape[0]).to(device)
                v = velocity(pipe, x, t, traj["embeds"][rows], traj["pooled"][rows])
                _, log_prob, _, _ = sde_transition(
                    v,
                    x,
                    traj["sigmas"][j],
                    traj["sigmas"][j + 1],
                    traj["sigma_max"],
                    cfg.noise_level,
                    prev_sample=traj["latents"][rows, j + 1],
                )
                ratio = torch.exp(log_prob - traj["log_probs"][rows, j])
                a = adv[rows]
                loss = torch.maximum(-a * ratio, -a * ratio.clamp(1 - cfg.clip_ratio, 1 + cfg.clip_ratio)).mean()
                (loss / (n_micro * W)).backward()
                ratios.append(ratio.detach())
                losses.append(loss.detach())
                clipped.append(((ratio.detach() - 1).abs() > cfg.clip_ratio).float())
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else math.inf)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    pipe.transformer.eval()
    r = torch.cat(ratios)
    return {
        "ratio_mean": r.mean().item(),
        "ratio_max_abs_dev": (r - 1).abs().max().item(),
        "pg_loss": torch.stack(losses).mean().item(),
        "pg_clipfrac": torch.cat(clipped).mean().item(),
        "grad_norm": sum(grad_norms) / len(grad_norms),
    }


# ---------------------------------------------------------------------------------------- loop
def load_pipeline(cfg: ReferenceConfig) -> StableDiffusion3Pipeline:
    """The pipeline in fp32; only the transformer is trained."""
    diffusers_logging.disable_progress_bar()
    pipe = StableDiffusion3Pipeline.from_pretrained(cfg.model_path, dtype=torch.float32).to(cfg.device)
    for module in (pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
        if module is not None:
            module.requires_grad_(False)
    pipe.transformer.requires_grad_(True).eval()
    return pipe


def run_reference(cfg: ReferenceConfig, steps: int) -> list[dict]:
    """Train ``steps`` steps in this process; returns per-step metrics (reward mean, timings, ratio)."""
    if cfg.window_range[1] > cfg.num_steps or not 1 <= cfg.window_size <= cfg.window_range[1] - cfg.window_range[0]:
        raise ValueError(f"window_size={cfg.window_size} must fit in window_range={cfg.window_range} of {cfg.num_steps} steps")
    if len(cfg.prompts) < cfg.prompts_per_step or cfg.prompts_per_step % cfg.mini_batch_prompts:
        raise ValueError(
            f"{len(cfg.prompts)} prompts, prompts_per_step={cfg.prompts_per_step}, mini_batch_prompts={cfg.mini_batch_prompts}: "
            "need at least prompts_per_step prompts and prompts_per_step divisible by mini_batch_prompts"
        )
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    pipe = load_pipeline(cfg)
    params = [p for p in pipe.transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    noise_gen = torch.Generator().manual_seed(cfg.seed)
    data_gen = torch.Generator().manual_seed(cfg.seed)
    order: list[int] = []
    out = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        if len(order) < cfg.prompts_per_step:  # a new epoch: reshuffle the prompts
            order = torch.randperm(len(cfg.prompts), generator=data_gen).tolist()
        batch, order = [cfg.prompts[i] for i in order[: cfg.prompts_per_step]], order[cfg.prompts_per_step :]
        traj = rollout(pipe, batch, cfg, noise_gen)
        t1 = time.perf_counter()
        rewards = jpeg_compressibility(traj["images"])
        adv = grpo_advantages(rewards, cfg.n)
        metrics = update(pipe, optimizer, traj, adv, cfg)
        t2 = time.perf_counter()
        out.append(
            {
                "step": step,
                "reward_mean": rewards.mean().item(),
                "gen_s": t1 - t0,
                "update_s": t2 - t1,
                "step_s": t2 - t0,
                "images": int(rewards.numel()),
                "window_start": traj["window_start"],
                **metrics,
            }
        )
        print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in out[-1].items()}), flush=True)
    return out


def read_prompts(path: str | Path) -> list[str]:
    """One prompt per line; blank lines and ``#`` comments skipped."""
    lines = [line.strip() for line in Path(path).read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def build_parser() -> argparse.ArgumentParser:
    d = ReferenceConfig(model_path="", prompts=[])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=str(REPO / "models" / "tiny-sd3"), help="diffusers SD3 pipeline folder")
    p.add_argument("--prompts-file", default=str(DEFAULT_PROMPTS_FILE), help="text file, one prompt per line")
    p.add_argument("--steps", type=int, default=10, help="training steps")
    p.add_argument("--prompts-per-step", type=int, default=d.prompts_per_step)
    p.add_argument("--n", type=int, default=d.n, help="samples per prompt (group size)")
    p.add_argument("--height", type=int, default=d.height)
    p.add_argument("--width", type=int, default=d.width)
    p.add_argument("--num-steps", type=int, default=d.num_steps, help="denoising steps")
    p.add_argument("--noise-level", type=float, default=d.noise_level)
    p.add_argument("--window-size", type=int, default=d.window_size, help="SDE (trained) steps per sample")
    p.add_argument("--window-range", type=int, nargs=2, default=list(d.window_range), metavar=("START", "END"))
    p.add_argument("--max-sequence-length", type=int, default=d.max_sequence_length)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--betas", type=float, nargs=2, default=list(d.betas), metavar=("BETA1", "BETA2"), help="AdamW betas")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip)
    p.add_argument("--clip-ratio", type=float, default=d.clip_ratio)
    p.add_argument("--adv-clip-max", type=float, default=d.adv_clip_max)
    p.add_argument("--mini-batch-prompts", type=int, default=d.mini_batch_prompts, help="groups per optimizer step")
    p.add_argument("--micro-batch", type=int, default=d.micro_batch, help="samples per forward/backward")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads (default: os.cpu_count())")
    p.add_argument("--device", default=d.device)
    p.add_argument("--out", default=None, help="write the config and per-step metrics as JSON here")
    return p


def config_from_args(ns: argparse.Namespace) -> ReferenceConfig:
    skip = {"prompts_file", "steps", "out", "window_range", "betas"}
    fields = {k: v for k, v in vars(ns).items() if k not in skip}
    prompts = read_prompts(ns.prompts_file)
    return ReferenceConfig(**fields, prompts=prompts, window_range=tuple(ns.window_range), betas=tuple(ns.betas))


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    cfg = config_from_args(ns)
    steps = run_reference(cfg, ns.steps)
    if ns.out:
        Path(ns.out).write_text(json.dumps({"config": asdict(cfg), "steps": steps}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
