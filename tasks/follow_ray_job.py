"""`follow_ray_job`: a submitted Ray job's log lines into this run's log as they come, until the job ends
(`omni_core.distributed.ray_job.follow_job`). Interrupted (a cancellation's SIGTERM, Ctrl-C), it stops the job
before it re-raises, so a stopped flow run never leaves its training running on the cluster.
"""

from __future__ import annotations

from prefect import get_run_logger, task

from omni_core.distributed.ray_job import JobOutcome, follow_job, job_client, stop_job


@task(name="follow_ray_job", retries=0)
def follow_ray_job(address: str, job_id: str) -> JobOutcome:
    logger = get_run_logger()
    client = job_client(address)
    try:
        return follow_job(client, job_id, logger.info)
    except BaseException:
        status = stop_job(client, job_id)
        logger.warning(f"Ray job {job_id} stopped (status {status}): this run was interrupted")
        raise
