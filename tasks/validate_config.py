"""Stage 1 — `validate_config`: verl-omni's `main()` checks (`auto_set_device`, `validate_config`,
`validate_attention_consistency`), run in the flow process before any Ray or TQ process starts.

A run started through a deployment (the UI, the API, a schedule: Prefect sets `runtime.deployment.id`)
takes reward files only from the folders the serving side allows (`OMNIFLOW_ALLOWED_REWARD_DIRS`, plus
OmniFlow's `examples/rewards`), since a reward file is code the run executes; a user's own call takes any path.
"""

from __future__ import annotations

from prefect import runtime, task

from omni_core.config import OmniFlowConfig
from omni_core.validation import prepare_run_config
from omni_core.validation.rewards import deployment_reward_dirs


@task(name="validate_config", retries=0)
def validate_config(
    config: OmniFlowConfig | None, overrides: list[str], config_files: list[str], experiment_suffix: str | None = None
) -> OmniFlowConfig:
    """Resolve and check the run's config; every problem is reported at once, with its key path."""
    allowed = deployment_reward_dirs() if runtime.deployment.id else None
    return prepare_run_config(config, overrides, config_files, experiment_suffix, allowed_reward_dirs=allowed)
