"""Stage 1 — `validate_config`: verl-omni's `main()` checks (`auto_set_device`, `validate_config`,
`validate_attention_consistency`), run in the flow process before any Ray or TQ process starts."""

from __future__ import annotations

from prefect import task

from omni_core.config import OmniFlowConfig, load_config, with_updates
from omni_core.config.loader import parse_override
from omni_core.device import auto_set_device
from omni_core.validation import validate_attention_consistency
from omni_core.validation import validate_config as check_config


def resolve_config(config: OmniFlowConfig | None, overrides: list[str], config_files: list[str]) -> OmniFlowConfig:
    """A flow parameter config (or the defaults / files) with `key.path=value` overrides on top."""
    if config is None:
        return load_config(config_files, overrides)
    return with_updates(config, dict(map(parse_override, overrides))) if overrides else config


@task(name="validate_config", retries=0)
def validate_config(config: OmniFlowConfig | None, overrides: list[str], config_files: list[str]) -> OmniFlowConfig:
    """Resolve and check the run's config; every problem is reported at once, with its key path."""
    cfg = auto_set_device(resolve_config(config, overrides, config_files))
    # v1 forces the TransferQueue on, as verl-omni's runner does.
    cfg = with_updates(cfg, {"transfer_queue.enable": True})
    check_config(cfg)
    validate_attention_consistency(cfg)
    return cfg
