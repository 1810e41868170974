"""OmniFlow configuration: the schema, the defaults YAML, loading with overrides, errors."""

from omni_core.config.errors import ConfigError, ConfigProblem
from omni_core.config.loader import (
    config_from_dict,
    load_config,
    parse_override,
    parse_value,
    resolve_config,
    to_flat_dict,
    to_yaml,
    with_experiment_suffix,
    with_updates,
)
from omni_core.config.schema import OmniFlowConfig

__all__ = [
    "ConfigError",
    "ConfigProblem",
    "OmniFlowConfig",
    "config_from_dict",
    "load_config",
    "parse_override",
    "parse_value",
    "resolve_config",
    "to_flat_dict",
    "to_yaml",
    "with_experiment_suffix",
    "with_updates",
]
