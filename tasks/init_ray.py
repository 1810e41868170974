"""Stage 2a — `init_ray`: verl-omni's `ray.init(**ray_kwargs.ray_init)` in the Ray driver.

Joins `ray_kwargs.ray_init.address` or starts a local cluster with enough logical CPUs, and checks the
cluster against the run's resource budget (the TransferQueue's reservations included), so nothing is
left pending forever. The TransferQueue itself starts in the next stage, `init_transfer_queue`. When a Ray
dashboard runs, its address is in the run's log and a link artifact `omniflow-ray-dashboard`.
"""

from __future__ import annotations

from omniflow.tasks.retry_policy import retry_infrastructure_failures
from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact

from omni_core.config import OmniFlowConfig
from omni_core.distributed.ray_cluster import connect_run_cluster


@task(name="init_ray", retries=2, retry_delay_seconds=2, retry_condition_fn=retry_infrastructure_failures)
def init_ray(config: OmniFlowConfig) -> bool:
    """Returns True when this run started the Ray cluster (and so must shut it down)."""
    cluster = connect_run_cluster(config)
    get_run_logger().info(
        f"Ray dashboard: {cluster.dashboard_url}"
        if cluster.dashboard_url
        else "Ray dashboard: not running (ray_kwargs.ray_init.include_dashboard=true starts it)"
    )
    if cluster.dashboard_url:
        create_link_artifact(
            key="omniflow-ray-dashboard",
            link=cluster.dashboard_url,
            link_text="Ray dashboard",
            description="The Ray cluster of this run: actors, tasks, logs, resources",
        )
    if cluster.auth_warning:
        get_run_logger().warning(cluster.auth_warning)
    return cluster.owns_ray
