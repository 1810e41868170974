"""`omniflow train` (also `python -m omniflow.flows.main_diffusion_v1`): the main job, verl style.

The config is checked first (about a second, nothing started), then `runner.run_flow_from_cli` starts
the embedded Prefect API (unless `PREFECT_API_URL` is set) and runs `main_diffusion_v1`; at the end
this prints where the checkpoints, metrics and artifacts are and how the reward moved.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from omniflow.flows.runner import run_flow_from_cli, split_files_and_overrides

FLOW = "omniflow.flows.main_diffusion_v1:main_diffusion_v1"


def run_training(args: Sequence[str]) -> int:
    from omni_core.config import ConfigError
    from omni_core.validation import prepare_run_config

    try:
        files, overrides = split_files_and_overrides(args)  # --config-path/--config-name too
        prepare_run_config(None, overrides, files)
    except ConfigError as exc:
        print(f"omniflow: {exc}", file=sys.stderr)
        return 2
    return run_flow_from_cli("omniflow", FLOW, {"config": None, "overrides": overrides, "config_files": files}, _report)


def _report(result: Any) -> None:
    print("omniflow: run finished", flush=True)
    if result.note:  # a finished experiment: the flow's state message; the run wrote no metrics, images or rewards
        print(f"  nothing trained: {result.note}")
        print(f"  checkpoints:      {result.checkpoint_dir} (last: {result.final_checkpoint})")
        print("  artifacts:        omniflow-run-summary (Prefect UI)")
        return
    print(f"  run id:           {result.run_id}")
    print(f"  steps trained:    {result.global_step}")
    print(f"  checkpoints:      {result.checkpoint_dir} (last: {result.final_checkpoint})")
    print(f"  metrics:          {result.log_dir}")
    print(
        "  artifacts:        omniflow-run-summary (reward curve), omniflow-validation (image grids), "
        "omniflow-reward-curve, omniflow-epoch-metrics, omniflow-checkpoint, omniflow-progress (Prefect UI)"
    )
    if getattr(result, "margin_first", None) is not None:  # Diffusion-DPO: how far the policy prefers the chosen images
        print(f"  DPO margin (actor/rewards/margins), first steps: {result.margin_first:.6f}")
        print(f"  DPO margin (actor/rewards/margins), last steps:  {result.margin_last:.6f}")
    if getattr(result, "offline", False):  # the rewards are the data set's scores: nothing to compare
        return
    print(f"  mean reward, first steps: {result.reward_first:.6f}")
    change = result.reward_last - result.reward_first
    verdict = "higher" if change > 0 else "not higher"
    noise = getattr(result, "reward_step_noise", None)
    if noise:  # how far the change stands out of the step-to-step noise
        verdict += f" by {change / noise:+.1f} x the step-to-step noise sd {noise:.6f}"
    print(f"  mean reward, last steps:  {result.reward_last:.6f}  ({verdict})")
    for line in validation_lines(result):
        print(f"  {line}")


def validation_lines(result: Any) -> list[str]:
    """The validation rewards of the run, labelled: before training (step 0) and after (the last validation)."""
    before, last, step = result.val_before_train, result.val_metrics, result.val_step
    lines = []
    if before:
        lines.append(f"validation before training: {_metrics_text(before)}")
    if last and step:
        lines.append(f"validation after step {step}:  {_metrics_text(last)}")
    elif before:
        lines.append("no validation after training (set trainer.test_freq=N to validate every N steps and at the end)")
    return lines


def _metrics_text(metrics: dict[str, float]) -> str:
    return ", ".join(f"{key} {value:.6f}" for key, value in sorted(metrics.items()))
