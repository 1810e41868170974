"""OmniFlow configuration: the schema, the defaults YAML, composing files and overrides (OmegaConf), errors."""

from omni_core.config.compose import config_name_file, parse_override, parse_value
from omni_core.config.errors import ConfigError, ConfigProblem
from omni_core.config.loader import (
    config_and_problems,
    config_from_dict,
    load_config,
    load_config_and_problems,
    resolve_config,
    resolve_config_and_problems,
    to_flat_dict,
    to_yaml,
    with_experiment_suffix,
    with_updates,
)
from omni_core.config.schema import OmniFlowConfig, torch_dtype_name

__all__ = [
    "ConfigError",
    "ConfigProblem",
    "OmniFlowConfig",
    "config_and_problems",
    "config_from_dict",
    "config_name_file",
    "load_config",
    "load_config_and_problems",
    "parse_override",
    "parse_value",
    "resolve_config",
    "resolve_config_and_problems",
    "to_flat_dict",
    "to_yaml",
    "torch_dtype_name",
    "with_experiment_suffix",
    "with_updates",
]
