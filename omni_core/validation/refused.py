"""Keys at their only implemented value: `REFUSED_WHEN_NOT_DEFAULT` (`omni_core.config.unsupported`), applied.

A key OmniFlow has but implements only at its default (a standalone rollout pool, sampler staleness, CPU
offload, data-parallel ranks, ...) is refused at any other value with the table's reason, instead of
being accepted and ignored. The same table tells the key-coverage test which keys nothing else reads.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from omni_core.config import ConfigProblem, OmniFlowConfig
from omni_core.config.unsupported import REFUSED_WHEN_NOT_DEFAULT


def config_value(config: Any, path: str) -> Any:
    """The value at a dotted key path of a config object."""
    for part in path.split("."):
        config = getattr(config, part)
    return config


@cache
def default_config() -> OmniFlowConfig:
    return OmniFlowConfig()


def refused_value_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    p: list[ConfigProblem] = []
    for key, reason in REFUSED_WHEN_NOT_DEFAULT.items():
        value, default = config_value(config, key), config_value(default_config(), key)
        if value != default:
            shown = "null" if default is None else str(default).lower() if isinstance(default, bool) else default
            p.append(ConfigProblem(key, f"not supported by OmniFlow (only {shown} is implemented): {reason}", value))
    return p
