#!/usr/bin/env python
"""How strong each KL penalty (`actor_rollout_ref.actor.kl_loss_type`) is, step by step of a schedule, for one gap.

`transition_mean` (flow_grpo's and verl-omni's KL) compares the reverse-SDE transition means,
``mean((mu - mu_ref)^2) / (2 std_dev_t^2)``; `velocity` compares the predicted velocities, ``mean((v - v_ref)^2)``.
The means are linear in the velocity, so for one velocity gap the ratio velocity / transition_mean does not depend on
the gap, only on the step: ``2 std_dev_t^2 / (g^2 dt^2)``, ``g = d mu / d v`` (the SDE's factor of ``dt``). This script
measures it with omni_core's own SDE step (`omni_core.sde.sde_step_from_sigmas`) and losses (`omni_core.algorithms.
flow_grpo.kl_loss`, `velocity_kl_loss`) on a random gap, for the scheduler's sigmas of `--steps` steps (a
FlowMatchEulerDiscreteScheduler with `--shift`, as SD3's), and gives the velocity coefficient that matches a
transition-mean coefficient on average over the steps a window can train (all but the last).

    python benchmarks/kl_scales.py [--steps 10] [--shift 3.0] [--noise-level 0.7] [--sde-type sde] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from omni_core.algorithms.flow_grpo import kl_loss, velocity_kl_loss  # noqa: E402
from omni_core.sde import sde_step_from_sigmas  # noqa: E402


def schedule(steps: int, shift: float) -> torch.Tensor:
    """The scheduler's sigmas ``[steps + 1]`` (ending at 0), as a pipeline sets them."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(steps)
    return scheduler.sigmas.float()


def kl_ratios(sigmas: torch.Tensor, noise_level: float, sde_type: str, seed: int = 0) -> list[dict[str, float]]:
    """Per step ``j`` (all but the last, whose next sigma is 0): both penalties for one random gap and their ratio."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 16, 8, 8, generator=g)
    v_ref = torch.randn(x.shape, generator=g)
    v = v_ref + 0.01 * torch.randn(x.shape, generator=g)
    rows = []
    for j in range(len(sigmas) - 2):
        sigma, nxt = float(sigmas[j]), float(sigmas[j + 1])
        step = dict(sigma=sigma, sigma_next=nxt, sigma_max=float(sigmas[1]), noise_level=noise_level, sde_type=sde_type)
        _, _, mean, std = sde_step_from_sigmas(v, x, prev_sample=x, **step)
        _, _, mean_ref, _ = sde_step_from_sigmas(v_ref, x, prev_sample=x, **step)
        transition = float(kl_loss(mean, mean_ref, std))
        velocity = float(velocity_kl_loss(v, v_ref))
        rows.append(
            {
                "step": j,
                "sigma": sigma,
                "dt": nxt - sigma,
                "std_dev_t": float(std.flatten()[0]),
                "transition_mean_kl": transition,
                "velocity_kl": velocity,
                "velocity_over_transition": velocity / transition,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--shift", type=float, default=3.0)
    parser.add_argument("--noise-level", type=float, default=0.7)
    parser.add_argument("--sde-type", default="sde", choices=["sde", "dance_sde", "cps"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = kl_ratios(schedule(args.steps, args.shift), args.noise_level, args.sde_type)
    ratios = [r["velocity_over_transition"] for r in rows]
    result = {
        "config": vars(args) | {"out": str(args.out) if args.out else None},
        "steps": rows,
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratio_median": statistics.median(ratios),
        # kl_loss_coef under `velocity` that gives the same penalty as a transition_mean coefficient of 1, averaged
        # over the trainable steps (the mean of the per-step ratios' inverses)
        "velocity_coef_per_transition_coef": statistics.fmean(1.0 / r for r in ratios),
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
