"""The attention-backend pair (verl-omni's `validate_attention_consistency`): the actor's
`attn_backend` and the rollout's `rollout_attn_backend` must come from one kernel family, because
kernel differences between training and rollout bias the log-prob ratios."""

from __future__ import annotations

from omni_core.config import ConfigError, ConfigProblem, OmniFlowConfig

# Actor attention backends (diffusers' dispatcher names) by family, and the rollout backends each pairs with.
ACTOR_ATTN_FAMILIES: dict[str, tuple[str, ...]] = {
    "sdpa": ("native", "_native_npu", "_native_cudnn", "_native_efficient", "_native_flash", "_native_math"),
    "flash": (
        "flash",
        "flash_hub",
        "flash_varlen",
        "flash_varlen_hub",
        "_flash_3",
        "_flash_3_hub",
        "_flash_3_varlen_hub",
        "_flash_varlen_3",
    ),
}
ROLLOUT_ATTN_FAMILIES: dict[str, tuple[str, ...]] = {
    "sdpa": ("TORCH_SDPA",),
    "flash": ("FLASH_ATTN", "FLASH_ATTN_3", "FLASH_ATTN_HUB", "FLASH_ATTN_3_HUB"),
}
_PAIR_EXAMPLE = {"sdpa": ("native", "TORCH_SDPA"), "flash": ("_flash_3", "FLASH_ATTN_3")}


def _family(backend: str, families: dict[str, tuple[str, ...]]) -> str | None:
    return next((fam for fam, names in families.items() if backend in names), None)


def attention_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    """Problems of the actor / rollout attention-backend pair (see `validate_attention_consistency`)."""
    actor = config.actor_rollout_ref.model.attn_backend
    rollout = config.actor_rollout_ref.rollout.rollout_attn_backend
    problems = []
    actor_fam = _family(actor, ACTOR_ATTN_FAMILIES)
    rollout_fam = _family(rollout, ROLLOUT_ATTN_FAMILIES)
    if actor_fam is None:
        known = ", ".join(n for names in ACTOR_ATTN_FAMILIES.values() for n in names)
        problems.append(
            ConfigProblem("actor_rollout_ref.model.attn_backend", f"unknown attention backend; known: {known}", actor)
        )
    if rollout_fam is None:
        known = ", ".join(n for names in ROLLOUT_ATTN_FAMILIES.values() for n in names)
        problems.append(
            ConfigProblem("actor_rollout_ref.rollout.rollout_attn_backend", f"unknown attention backend; known: {known}", rollout)
        )
    if actor_fam and rollout_fam and actor_fam != rollout_fam:
        a, r = _PAIR_EXAMPLE[actor_fam]
        problems.append(
            ConfigProblem(
                "actor_rollout_ref.model.attn_backend",
                f"does not pair with actor_rollout_ref.rollout.rollout_attn_backend={rollout} (kernel differences "
                f"between training and rollout bias the log-prob ratios); a valid pair is "
                f"attn_backend={a} with rollout_attn_backend={r}, or set rollout_attn_backend to one of "
                f"{', '.join(ROLLOUT_ATTN_FAMILIES[actor_fam])}",
                actor,
            )
        )
    return problems


def validate_attention_consistency(config: OmniFlowConfig) -> None:
    """The actor's `attn_backend` must pair with the rollout's `rollout_attn_backend`.

    native / SDPA-family backends pair with TORCH_SDPA; flash-family ones with the FLASH_ATTN family.
    """
    problems = attention_problems(config)
    if problems:
        raise ConfigError(problems)
