"""Rewards: reward files that exist and parse, the other entries (`reward_terms`), and no reward key left unused.

A reward file is Python that the run imports and executes. A run started through a deployment (the Prefect
UI, the API, a schedule) takes its parameters from whoever can reach that API, so such a run accepts reward
files only inside `allowed_reward_dirs` (the serving side's `OMNIFLOW_ALLOWED_REWARD_DIRS`, os.pathsep-separated,
plus OmniFlow's own `examples/rewards`); a user's own `omniflow train` or Python call passes None: any path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from omni_core.config import ConfigProblem, OmniFlowConfig
from omni_core.rewards.custom import DEFAULT_FUNCTION_NAME, RewardLoadError, check_reward_source
from omni_core.rewards.entries import entry_kind, given_entry_keys
from omni_core.validation.reward_terms import entry_problems, reward_model_problems

ALLOWED_REWARD_DIRS_ENV = "OMNIFLOW_ALLOWED_REWARD_DIRS"
EXAMPLE_REWARDS_DIR = Path(__file__).resolve().parents[2] / "examples" / "rewards"


def deployment_reward_dirs(environ: Mapping[str, str] | None = None) -> list[Path]:
    """The folders a deployment-triggered run may take reward files from: OmniFlow's `examples/rewards` plus
    every folder in `OMNIFLOW_ALLOWED_REWARD_DIRS` (os.pathsep-separated) of `environ` (default: os.environ)."""
    env = os.environ if environ is None else environ
    extra = [Path(d).expanduser() for d in env.get(ALLOWED_REWARD_DIRS_ENV, "").split(os.pathsep) if d.strip()]
    return [EXAMPLE_REWARDS_DIR, *extra]


def _outside(path: str, allowed: Sequence[str | Path]) -> bool:
    file = Path(path).expanduser().resolve()  # symlinks and `..` resolved: the file that would be imported
    return not any(file.is_relative_to(Path(d).expanduser().resolve()) for d in allowed)


def _not_allowed(key: str, path: str, allowed: Sequence[str | Path]) -> ConfigProblem:
    dirs = os.pathsep.join(str(d) for d in allowed)
    return ConfigProblem(
        key,
        f"a run started through a deployment imports reward files only from the folders the serving side allows "
        f"({dirs}); reward files run code. Move the file there, or allow its folder where the deployment is served: "
        f"{ALLOWED_REWARD_DIRS_ENV}=<dir>[{os.pathsep}<dir>...] or `omniflow serve --allow-reward-dir <dir>`",
        path,
    )


def _source_problems(key: str, path: str, function: str) -> list[ConfigProblem]:
    """A reward file that would fail to load (syntax, missing function, missing package), found by parsing it:
    validation never executes a reward file (`check_reward_source`)."""
    try:
        check_reward_source(path, function)
    except RewardLoadError as exc:
        return [ConfigProblem(key, str(exc), path)]
    return []


def reward_problems(config: OmniFlowConfig, allowed_reward_dirs: Sequence[str | Path] | None = None) -> list[ConfigProblem]:
    """Every reward problem of `config`; with `allowed_reward_dirs` (deployment runs), reward files outside
    those folders too. None accepts any path (a user's own call)."""
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
    elif custom and allowed_reward_dirs is not None and _outside(custom, allowed_reward_dirs):
        p.append(_not_allowed("reward.custom_reward_function.path", custom, allowed_reward_dirs))
    elif custom:
        p.extend(_source_problems("reward.custom_reward_function.path", custom, reward.custom_reward_function.name))
    elif reward.custom_reward_function.name != DEFAULT_FUNCTION_NAME:
        # A function name with no file would be read by nothing: the samples' data_source picks the reward.
        p.append(
            ConfigProblem(
                "reward.custom_reward_function.name",
                "names a function of reward.custom_reward_function.path, which is not set: set the path to the file that "
                "defines it, or remove the name (each sample's data_source then picks a built-in reward)",
                reward.custom_reward_function.name,
            )
        )
    for i, spec in enumerate(reward.reward_functions):
        key = f"reward.reward_functions[{i}]"
        if spec.path and entry_kind(given_entry_keys(spec)) == "file":
            if not Path(spec.path).expanduser().is_file():
                p.append(ConfigProblem(f"{key}.path", "no such file; point it at a Python file", spec.path))
            elif allowed_reward_dirs is not None and _outside(spec.path, allowed_reward_dirs):
                p.append(_not_allowed(f"{key}.path", spec.path, allowed_reward_dirs))
            else:
                p.extend(_source_problems(f"{key}.path", spec.path, spec.function))
        p.extend(entry_problems(key, spec))  # keys of its kind; built-in names, model folders, server URLs
    p.extend(reward_model_problems(config))
    return p
