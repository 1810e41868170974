"""Stage 1 — `validate_config`: verl-omni's `main()` checks (`auto_set_device`, `validate_config`,
`validate_attention_consistency`), run in the flow process before any Ray or TQ process starts."""

from __future__ import annotations

from prefect import task

from omni_core.config import OmniFlowConfig
from omni_core.validation import prepare_run_config


@task(name="validate_config", retries=0)
def validate_config(
    config: OmniFlowConfig | None, overrides: list[str], config_files: list[str], experiment_suffix: str | None = None
) -> OmniFlowConfig:
    """Resolve and check the run's config; every problem is reported at once, with its key path."""
    return prepare_run_config(config, overrides, config_files, experiment_suffix)
