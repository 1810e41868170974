"""`submit_ray_job`: the training (or another entrypoint) as a job on an existing Ray cluster, through Ray's job
API at the head's dashboard address (`omni_core.distributed.ray_job`). No verl-omni counterpart: verl-omni's
`main_diffusion_v1` is itself what a Ray job of this kind runs.

Never retried: a second submission would be a second training run.
"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, runtime, task

from omni_core.distributed.ray_job import FLOW_RUN_METADATA, job_client, submit_job


@task(name="submit_ray_job", retries=0)
def submit_ray_job(address: str, entrypoint: str, runtime_env: dict[str, Any]) -> str:
    """Submit `entrypoint` with `runtime_env`; returns the job's submission id, which names this flow run (and its
    try) so that the flow's cancellation hook finds the job again from any process."""
    flow_run_id = str(runtime.flow_run.id)
    job_id = f"omniflow-{flow_run_id}-{runtime.flow_run.run_count or 1}"
    submit_job(job_client(address), entrypoint, runtime_env, job_id, {FLOW_RUN_METADATA: flow_run_id})
    get_run_logger().info(f"Ray job {job_id} submitted to {address}: {entrypoint}")
    return job_id
