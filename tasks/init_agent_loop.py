"""Stage 6 — `init_agent_loop`: verl-omni's `init_agent_loop_manager()`: the rollout workers (Ray
actors, created from the flow process so they outlive any one task), given the current weights."""

from __future__ import annotations

from omniflow.tasks.retry_policy import retry_infrastructure_failures
from prefect import task
from prefect.cache_policies import NO_CACHE

from omni_core.agent_loop import AgentLoopManager
from omni_core.trainers.base import PolicyGradientDiffusionTrainerV1


@task(
    name="init_agent_loop",
    cache_policy=NO_CACHE,
    retries=1,
    retry_delay_seconds=2,
    retry_condition_fn=retry_infrastructure_failures,
)
def init_agent_loop(trainer: PolicyGradientDiffusionTrainerV1) -> AgentLoopManager:
    return trainer.init_agent_loop()
