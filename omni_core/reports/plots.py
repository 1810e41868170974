"""Reward curves: the mean training reward per step (with its min-max band) and the validation rewards,
as a PNG whose title says whether the reward went up -- the picture a person opens first."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

REWARD = "critic/rewards/mean"
WINDOW = 3  # steps averaged for the first and the last reward


def reward_trend(rewards: Sequence[float], window: int = WINDOW) -> tuple[float, float, str]:
    """(mean of the first `window` rewards, mean of the last `window`, "up" / "down" / "flat")."""
    values = [r for r in rewards if not math.isnan(r)]
    if not values:
        return math.nan, math.nan, "no steps"
    first = sum(values[:window]) / len(values[:window])
    last = sum(values[-window:]) / len(values[-window:])
    return first, last, "up" if last > first else "down" if last < first else "flat"


def step_noise(rewards: Sequence[float]) -> float:
    """The step-to-step noise of a run's mean reward: the standard deviation of one step's value around a slow trend,
    estimated from consecutive differences, `std(r[t+1] - r[t]) / sqrt(2)` (a trend that moves little per step
    barely adds to it). NaN with fewer than 3 steps."""
    values = [r for r in rewards if not math.isnan(r)]
    if len(values) < 3:
        return math.nan
    diffs = [b - a for a, b in zip(values, values[1:], strict=False)]
    mean = sum(diffs) / len(diffs)
    return math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / 2)


def trend_line(rewards: Sequence[float], window: int = WINDOW) -> str:
    """`mean reward -0.008577 -> -0.008505 (up)`: first and last `window` steps."""
    first, last, verdict = reward_trend(rewards, window)
    return f"mean reward {first:.6f} -> {last:.6f} ({verdict})"


def load_plotting() -> None:
    """Import matplotlib with its file-only backend (Agg); `save_reward_curve` needs it. Separate so a
    process can pay the import up front, at a moment no stop signal is expected."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot  # noqa: F401


def save_reward_curve(
    step_metrics: Sequence[dict[str, float]], path: str | Path, val_points: Sequence[tuple[int, float]] = (), title: str = ""
) -> Path:
    """Draw `critic/rewards/mean` per step (band: min..max) and validation points; write a PNG."""
    load_plotting()
    import matplotlib.pyplot as plt

    rows = sorted((m for m in step_metrics if REWARD in m), key=lambda m: m["training/global_step"])
    steps = [int(m["training/global_step"]) for m in rows]
    mean = [m[REWARD] for m in rows]
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    try:
        if steps:
            lo = [m.get("critic/rewards/min", m[REWARD]) for m in rows]
            hi = [m.get("critic/rewards/max", m[REWARD]) for m in rows]
            ax.fill_between(steps, lo, hi, alpha=0.2, color="tab:blue", label="train min..max")
            ax.plot(steps, mean, marker="o", markersize=3, color="tab:blue", label="train mean")
        if val_points:
            vs, vr = zip(*sorted(val_points), strict=True)
            ax.plot(vs, vr, marker="s", linestyle="--", color="tab:orange", label="validation mean")
        ax.set_xlabel("global step")
        ax.set_ylabel("reward")
        ax.set_title(f"{title + ': ' if title else ''}{trend_line(mean)}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return path
