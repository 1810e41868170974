"""Stage 2 — `init_transfer_queue`: verl-omni's `tq.init(config.transfer_queue)` in the Ray driver.

Connects Ray first (`ray_kwargs.ray_init`: join an address, or a local cluster with enough logical
CPUs) and checks the cluster against the run's resource budget, so nothing is left pending forever.
"""

from __future__ import annotations

from omniflow.tasks.retry_policy import retry_infrastructure_failures
from prefect import get_run_logger, task

from omni_core.config import OmniFlowConfig
from omni_core.ray_cluster import start_run_cluster


@task(name="init_transfer_queue", retries=2, retry_delay_seconds=2, retry_condition_fn=retry_infrastructure_failures)
def init_transfer_queue(config: OmniFlowConfig) -> bool:
    """Returns True when this run started the Ray cluster (and so must shut it down)."""
    cluster = start_run_cluster(config)
    get_run_logger().info(
        f"Ray dashboard: {cluster.dashboard_url}"
        if cluster.dashboard_url
        else "Ray dashboard: not running (ray_kwargs.ray_init.include_dashboard=true starts it)"
    )
    if cluster.auth_warning:
        get_run_logger().warning(cluster.auth_warning)
    return cluster.owns_ray
