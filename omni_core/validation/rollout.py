"""Rollout and SDE sampling: the SDE window inside the denoising steps, rollout log-probs for bypass mode."""

from __future__ import annotations

from omni_core.config import ConfigProblem, OmniFlowConfig


def rollout_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    p: list[ConfigProblem] = []
    rollout = config.actor_rollout_ref.rollout
    # The last step has sigma_next = 0 and cannot be an SDE step.
    steps = rollout.pipeline.num_inference_steps
    window, window_range = rollout.algo.sde_window_size, rollout.algo.sde_window_range
    if window is not None and window > steps - 1:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.rollout.algo.sde_window_size",
                f"must be <= rollout.pipeline.num_inference_steps - 1 = {steps - 1}",
                window,
            )
        )
    if window_range is not None:
        start, end = window_range
        if not 0 <= start < end <= steps - 1:
            p.append(
                ConfigProblem(
                    "actor_rollout_ref.rollout.algo.sde_window_range",
                    f"must satisfy 0 <= start < end <= num_inference_steps - 1 = {steps - 1}",
                    list(window_range),
                )
            )
        elif window is not None and window <= steps - 1 and end - start < window:
            p.append(
                ConfigProblem(
                    "actor_rollout_ref.rollout.algo.sde_window_range",
                    f"is narrower than actor_rollout_ref.rollout.algo.sde_window_size={window}",
                    list(window_range),
                )
            )
    # pipeline.guidance_scale / true_cfg_scale per architecture: the `guidance` group.
    if config.algorithm.rollout_correction.bypass_mode and not rollout.calculate_log_probs:
        p.append(
            ConfigProblem(
                "algorithm.rollout_correction.bypass_mode",
                "uses the rollout's log-probs; set actor_rollout_ref.rollout.calculate_log_probs=true",
                True,
            )
        )
    return p
