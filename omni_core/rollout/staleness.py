"""How far off-policy a trajectory is, in model versions, and the per-step staleness metrics.

A weight version is the global step whose update produced the weights (0: the base model). At training
step ``s`` the trainer's weights are version ``s - 1``; a trajectory sampled with version ``v`` is

    staleness = (s - 1 - v) / parameter_sync_step

model versions behind (0: on-policy, as in sync mode). verl's unit divides by ``parameter_sync_step`` the
same way but counts from the prompt's submission step, which adds ``1 / parameter_sync_step``: a verl
threshold ``T`` admits what OmniFlow's ``T - 1 / parameter_sync_step`` admits.
"""

from __future__ import annotations

from collections.abc import Sequence


def staleness(train_step: int, version: int, parameter_sync_step: int) -> float:
    """Model versions between the weights that sampled a trajectory and the weights training it at ``train_step``."""
    if parameter_sync_step < 1:
        raise ValueError(f"parameter_sync_step={parameter_sync_step} must be >= 1")
    return (train_step - 1 - version) / parameter_sync_step


def staleness_metrics(per_trajectory: Sequence[float], dropped_samples: int, worst: float) -> dict[str, float]:
    """verl-omni's names: ``training/off_policy/trajectory_staleness/{mean,max,min}`` over the trained
    trajectories, ``trajectory_staleness_worst`` (the most stale one seen this step, dropped ones included)
    and ``dropped_samples``."""
    prefix = "training/off_policy"
    metrics = {f"{prefix}/dropped_samples": float(dropped_samples), f"{prefix}/trajectory_staleness_worst": float(worst)}
    if per_trajectory:
        metrics[f"{prefix}/trajectory_staleness/mean"] = sum(per_trajectory) / len(per_trajectory)
        metrics[f"{prefix}/trajectory_staleness/max"] = max(per_trajectory)
        metrics[f"{prefix}/trajectory_staleness/min"] = min(per_trajectory)
    return metrics
