"""Rollout and SDE sampling: the SDE window inside the denoising steps, rollout log-probs for bypass mode."""

from __future__ import annotations

from omni_core.config import ConfigProblem, OmniFlowConfig
from omni_core.config.algorithm_names import FORWARD_PROCESS_ALGORITHMS, REFUSED_ROLLOUT_RS_OPTIONS, ROLLOUT_RS_OPTIONS


def rollout_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    p: list[ConfigProblem] = []
    rollout = config.actor_rollout_ref.rollout
    # The last step (sigma_next = 0) is an SDE step like the others for `sde` and `dance_sde` (flow_grpo's base config
    # trains it: the final latents then carry that step's noise); `cps`'s noise there is sigma_next * sin(..) = 0, a
    # degenerate Gaussian with no log-prob. Without a range the window lies in every step but the last (verl-omni's
    # default), so including the last step takes sde_window_range=[.., num_inference_steps]. A forward-process
    # algorithm (DiffusionNFT, DPO) samples the ODE and reads no window (validation.direct_preference refuses window keys
    # set for it).
    steps = rollout.pipeline.num_inference_steps
    window, window_range = rollout.algo.sde_window_size, rollout.algo.sde_window_range
    if config.actor_rollout_ref.model.algorithm in FORWARD_PROCESS_ALGORITHMS:
        window, window_range = None, None
    last_step_sde = rollout.algo.sde_type != "cps"
    max_end = steps if last_step_sde else steps - 1
    why_end = (
        "the last step can be in the window with sde_type=sde or dance_sde"
        if last_step_sde
        else "sde_type=cps cannot train the last step: its noise there is sigma_next * sin(noise_level * pi / 2) = 0"
    )
    if window_range is not None:
        start, end = window_range
        if not 0 <= start < end <= max_end:
            p.append(
                ConfigProblem(
                    "actor_rollout_ref.rollout.algo.sde_window_range",
                    f"must satisfy 0 <= start < end <= {max_end} (num_inference_steps={steps}; {why_end})",
                    list(window_range),
                )
            )
        elif window is not None and end - start < window:
            p.append(
                ConfigProblem(
                    "actor_rollout_ref.rollout.algo.sde_window_range",
                    f"is narrower than actor_rollout_ref.rollout.algo.sde_window_size={window}",
                    list(window_range),
                )
            )
    elif window is not None and window > steps - 1:
        fix = (
            f"; to train the last step as well (flow_grpo's base config), set "
            f"actor_rollout_ref.rollout.algo.sde_window_range=[{steps - window},{steps}]"
            if last_step_sde and window <= steps
            else ""
        )
        p.append(
            ConfigProblem(
                "actor_rollout_ref.rollout.algo.sde_window_size",
                f"must be <= rollout.pipeline.num_inference_steps - 1 = {steps - 1} without sde_window_range (the window "
                f"then lies in every step but the last, as verl-omni places it){fix}",
                window,
            )
        )
    p += _mix_grpo_problems(config)
    p += _rollout_correction_problems(config)
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


# MixGRPO's window keys: their defaults (verl-omni's) and the settings that read each (omni_core.rollout.mix_windows).
MIX_KEYS = {
    "sample_strategy": ("random", "model.algorithm=mix_grpo"),
    "iters_per_group": (1, "model.algorithm=mix_grpo with sample_strategy=progressive"),
    "sde_window_seed": (0, "model.algorithm=mix_grpo with sample_strategy=random"),
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
                    f"is read only by MixGRPO's window schedule ({reader}); this run has model.algorithm="
                    f"{config.actor_rollout_ref.model.algorithm}, sample_strategy={algo.sample_strategy}. Drop the key "
                    "or select what reads it",
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


def _threshold_problem(key: str, spec: object, lower_allowed: bool) -> str | None:
    """Why a threshold "U" / "L_U" (0 < L <= U) is malformed, or None."""
    lower_text, _, upper_text = str(spec).strip().rpartition("_")
    try:
        upper, lower = float(upper_text), float(lower_text) if lower_text else None
    except ValueError:
        return f"{key}={spec!r} is not a number U or a pair L_U"
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        return f"{key}={spec!r} must be U > 0 or L_U with 0 < L <= U"
    if lower is not None and not lower_allowed:
        return f"{key}={spec!r}: only k1 options take a pair L_U; give one bound U"
    return None


def _rollout_correction_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    """verl's rollout-correction keys: IS level and bound, RS options and bounds; both need the rollout's log-probs."""
    p: list[ConfigProblem] = []
    rc = config.algorithm.rollout_correction
    key = "algorithm.rollout_correction"
    if (rc.rollout_is or rc.rollout_rs) and not config.actor_rollout_ref.rollout.calculate_log_probs:
        p.append(
            ConfigProblem(
                f"{key}.{'rollout_is' if rc.rollout_is else 'rollout_rs'}",
                "compares the training policy with the rollout's log-probs; set actor_rollout_ref.rollout.calculate_log_probs=true",
                rc.rollout_is or rc.rollout_rs,
            )
        )
    if rc.rollout_is and (why := _threshold_problem(f"{key}.rollout_is_threshold", rc.rollout_is_threshold, True)):
        p.append(ConfigProblem(f"{key}.rollout_is_threshold", why, rc.rollout_is_threshold))
    if not rc.rollout_rs:
        if rc.rollout_rs_threshold is not None:
            p.append(
                ConfigProblem(f"{key}.rollout_rs_threshold", "is read only with rollout_rs set; drop it", rc.rollout_rs_threshold)
            )
        return p
    options = [o.strip() for o in rc.rollout_rs.split(",") if o.strip()]
    refused = [o for o in options if o in REFUSED_ROLLOUT_RS_OPTIONS]
    if refused:
        p.extend(
            ConfigProblem(f"{key}.rollout_rs", f"{o} is not supported: {REFUSED_ROLLOUT_RS_OPTIONS[o]}", rc.rollout_rs)
            for o in refused
        )
        return p
    unknown = [o for o in options if o not in ROLLOUT_RS_OPTIONS]
    if not options or unknown:
        p.append(
            ConfigProblem(
                f"{key}.rollout_rs", f"unknown option(s) {unknown}; choose from {', '.join(ROLLOUT_RS_OPTIONS)}", rc.rollout_rs
            )
        )
        return p
    if rc.rollout_rs_threshold is None:
        p.append(ConfigProblem(f"{key}.rollout_rs_threshold", f"must be set with rollout_rs={rc.rollout_rs}", None))
        return p
    specs = [s for s in str(rc.rollout_rs_threshold).split(",") if s.strip()]
    if len(specs) not in (1, len(options)):
        p.append(
            ConfigProblem(
                f"{key}.rollout_rs_threshold",
                f"give one threshold, or one per option of rollout_rs ({len(options)})",
                rc.rollout_rs_threshold,
            )
        )
        return p
    for option, spec in zip(options, specs * len(options) if len(specs) == 1 else specs, strict=True):
        if why := _threshold_problem(f"{key}.rollout_rs_threshold", spec, lower_allowed=option.endswith("k1")):
            p.append(ConfigProblem(f"{key}.rollout_rs_threshold", why, rc.rollout_rs_threshold))
            break
    return p
