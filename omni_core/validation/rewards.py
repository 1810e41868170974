"""Rewards: built-in names that exist and reward files that exist, and no reward key left unused."""

from __future__ import annotations

from pathlib import Path

from omni_core.config import ConfigProblem, OmniFlowConfig
from omni_core.rewards.names import BUILTIN_REWARD_NAMES


def reward_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    p: list[ConfigProblem] = []
    reward = config.reward
    custom = reward.custom_reward_function.path
    if custom and reward.reward_functions:
        # The weighted sum would win and the custom function would be silently unused.
        p.append(
            ConfigProblem(
                "reward.custom_reward_function.path",
                "is unused when reward.reward_functions is set; add it to reward.reward_functions as "
                "{path: ..., function: ..., weight: ...} or leave reward.reward_functions empty",
                custom,
            )
        )
    elif custom and not Path(custom).expanduser().is_file():
        p.append(ConfigProblem("reward.custom_reward_function.path", "no such file; point it at a Python file", custom))
    for i, spec in enumerate(reward.reward_functions):
        key = f"reward.reward_functions[{i}]"
        if spec.path:
            if not Path(spec.path).expanduser().is_file():
                p.append(ConfigProblem(f"{key}.path", "no such file; point it at a Python file", spec.path))
        elif not spec.name:
            p.append(ConfigProblem(key, f"needs a built-in name ({', '.join(BUILTIN_REWARD_NAMES)}) or a path", None))
        elif spec.name not in BUILTIN_REWARD_NAMES:
            p.append(
                ConfigProblem(
                    f"{key}.name",
                    f"no built-in reward of that name; built-ins: {', '.join(BUILTIN_REWARD_NAMES)} "
                    f"(or give a path to your own compute_score file)",
                    spec.name,
                )
            )
    return p
