"""Stage 1 — `validate_config`: verl-omni's `main()` checks (`auto_set_device`, `validate_config`,
`validate_attention_consistency`), run in the flow process before any Ray or TQ process starts."""

from __future__ import annotations

from pathlib import Path

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


def experiment_of_this_run(config: OmniFlowConfig, suffix: str) -> OmniFlowConfig:
    """`trainer.experiment_name` + `-<suffix>`, and an explicit `default_local_dir` gets a subfolder of
    that name: a scheduled run trains a new experiment instead of resuming an earlier one."""
    t = config.trainer
    name = f"{t.experiment_name}-{suffix}"
    updates: dict[str, object] = {"trainer.experiment_name": name}
    if t.default_local_dir:
        updates["trainer.default_local_dir"] = str(Path(t.default_local_dir) / name)
    return with_updates(config, updates)


@task(name="validate_config", retries=0)
def validate_config(
    config: OmniFlowConfig | None, overrides: list[str], config_files: list[str], experiment_suffix: str | None = None
) -> OmniFlowConfig:
    """Resolve and check the run's config; every problem is reported at once, with its key path."""
    cfg = auto_set_device(resolve_config(config, overrides, config_files))
    if experiment_suffix:
        cfg = experiment_of_this_run(cfg, experiment_suffix)
    # v1 forces the TransferQueue on, as verl-omni's runner does.
    cfg = with_updates(cfg, {"transfer_queue.enable": True})
    check_config(cfg)
    validate_attention_consistency(cfg)
    return cfg
