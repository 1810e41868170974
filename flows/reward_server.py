"""`omniflow reward-server`: read a reward config from YAML files and `reward.*` overrides, check it, serve it.

Thin: the server itself is `omni_core.rewards.server_app.serve` (uvicorn + starlette, scoring with the same
`RewardManager` a rollout worker uses). Only the `reward` section and `trainer.device` (where model rewards run)
mean anything to a reward server, so any other override is refused rather than ignored; a config file's other
sections are not read.
"""

from __future__ import annotations

from collections.abc import Sequence

from omniflow.flows.runner import split_files_and_overrides

SERVER_KEYS = ("reward.", "trainer.device=")


def run_reward_server(args: Sequence[str], host: str = "127.0.0.1", port: int = 8765) -> int:
    from omni_core.config import ConfigError, ConfigProblem, load_config
    from omni_core.rewards.server_app import serve
    from omni_core.validation.rewards import reward_problems

    files, overrides = split_files_and_overrides(args)
    other = [o for o in overrides if not o.lstrip("+~").startswith(SERVER_KEYS)]
    if other:
        raise ConfigError(
            [
                ConfigProblem(
                    o.split("=", 1)[0], "a reward server reads only reward.* keys and trainer.device; remove this override"
                )
                for o in other
            ]
        )
    config = load_config(files, overrides)
    problems = reward_problems(config)  # files exist and parse, model folders exist, URLs are http(s): before loading
    if problems:
        raise ConfigError(problems)
    serve(config.reward, device=config.trainer.device, host=host, port=port)
    return 0
