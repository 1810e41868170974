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
    p += _mix_grpo_problems(config)
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


# MixGRPO's window keys, their defaults (as verl-omni's) and what reads each (omni_core.rollout.mix_windows).
MIX_KEYS = {
    "sample_strategy": ("random", "MixGRPO"),
    "iters_per_group": (1, "MixGRPO's progressive strategy"),
    "sde_window_seed": (0, "MixGRPO's random strategy"),
}


def _mix_grpo_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    """MixGRPO places one window per step: it needs a window size and range; its keys do nothing under another
    sampling adapter or strategy."""
    p: list[ConfigProblem] = []
    algo = config.actor_rollout_ref.rollout.algo
    mix = config.actor_rollout_ref.model.algorithm == "mix_grpo"
    read = {"sample_strategy"} | ({"iters_per_group"} if algo.sample_strategy == "progressive" else {"sde_window_seed"})
    for key, (default, reader) in MIX_KEYS.items():
        value = getattr(algo, key)
        if value != default and not (mix and key in read):
            p.append(
                ConfigProblem(
                    f"actor_rollout_ref.rollout.algo.{key}",
                    f"is read only by {reader} (actor_rollout_ref.model.algorithm=mix_grpo"
                    + (
                        ""
                        if key == "sample_strategy"
                        else f", sample_strategy={'progressive' if key == 'iters_per_group' else 'random'}"
                    )
                    + f"); this run has model.algorithm={config.actor_rollout_ref.model.algorithm}, "
                    f"sample_strategy={algo.sample_strategy}. Drop the key or select what reads it",
                    value,
                )
            )
    if mix:
        for key, value in (("sde_window_size", algo.sde_window_size), ("sde_window_range", algo.sde_window_range)):
            if value is None:
                p.append(
                    ConfigProblem(
                        f"actor_rollout_ref.rollout.algo.{key}",
                        "MixGRPO (model.algorithm=mix_grpo) places a window of sde_window_size steps inside "
                        "sde_window_range each step; set both (verl-omni's MixGRPO falls back to the range [0, 5))",
                        None,
                    )
                )
    return p
