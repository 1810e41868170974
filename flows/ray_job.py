"""`ray_job`: the training as a job on an existing Ray cluster (a KubeRay RayCluster, a `ray up` cluster), submitted
through Ray's job API at the head's dashboard address, so a Prefect deployment or `omniflow ray-job` starts a
multi-node run without a shell on the head.

  1. submit_ray_job     `omniflow train <config files> <overrides> ray_kwargs.ray_init.address=auto` (the job's
                        driver joins the cluster the job runs on), with `runtime_env` plus `PREFECT_API_URL`: the
                        training reports to this run's Prefect API, where it shows as a flow run of its own
  2. follow_ray_job     the job's log lines into this run's log as they come, until it ends; the run fails unless
                        the job SUCCEEDED, with the job's status and message

Stopping this run stops the job: Ctrl-C or SIGTERM while it follows the job (`follow_ray_job`), and the
`on_cancellation` / `on_crashed` hook, which finds the run's jobs by their metadata from any process (a runner
that cancels a served run, a flow process that died).
"""

from __future__ import annotations

import sys
from typing import Any
from urllib.parse import urlparse

from omniflow.tasks.follow_ray_job import follow_ray_job
from omniflow.tasks.submit_ray_job import submit_ray_job
from prefect import flow, get_run_logger
from pydantic import BaseModel, Field

from omni_core.distributed.ray_job import (
    FLOW_RUN_METADATA,
    job_client,
    job_runtime_env,
    stop_jobs_with_metadata,
    train_entrypoint,
)

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class RayJobFailed(RuntimeError):
    """The job ended FAILED or STOPPED (not by this run)."""


class RayJobResult(BaseModel):
    job_id: str = Field(description="The job's submission id on the cluster (`ray job logs <id>`).")
    status: str = Field(description="Its final status: SUCCEEDED.")
    entrypoint: str = Field(description="The command the job ran.")


def stop_the_runs_jobs(flow: Any, flow_run: Any, state: Any) -> None:
    """`on_cancellation` / `on_crashed`: stop every job this flow run submitted that has not ended."""
    address = (flow_run.parameters or {}).get("address")
    if address:
        stopped = stop_jobs_with_metadata(job_client(address), FLOW_RUN_METADATA, str(flow_run.id))
        if stopped:
            print(f"ray_job: stopped Ray job(s) {stopped} of flow run {flow_run.id}", file=sys.stderr)


def prefect_api_for_the_job(address: str) -> str | None:
    """This run's Prefect API (the job reports there), with a warning when the cluster cannot reach it: an API on
    this machine's loopback while the cluster's dashboard is elsewhere."""
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    if api and urlparse(api).hostname in LOOPBACK and urlparse(address).hostname not in LOOPBACK:
        get_run_logger().warning(
            f"the Prefect API {api} listens on this machine only: the job's training on {address} cannot report to it; "
            "set PREFECT_API_URL to a server the cluster reaches (docs/scale-out.md), or runtime_env.env_vars.PREFECT_API_URL"
        )
    return api


@flow(name="ray_job", on_cancellation=[stop_the_runs_jobs], on_crashed=[stop_the_runs_jobs])
def ray_job(
    address: str,
    overrides: list[str] = [],  # noqa: B006  (Prefect parameters are copied per run)
    config_files: list[str] = [],  # noqa: B006
    runtime_env: dict[str, Any] | None = None,
    entrypoint: str | None = None,
) -> RayJobResult:
    """Train on an existing Ray cluster as a Ray job (the head's job API), following its logs here.

    Args:
        address: The Ray dashboard of the cluster, e.g. `http://head:8265` (KubeRay: `http://<cluster>-head-svc:8265`).
        overrides: verl-style `key.path=value` strings for `omniflow train`, e.g. `trainer.device=cuda`; paths as the
            cluster's nodes see them (its shared volume).
        config_files: YAML config files, as paths on the cluster's nodes.
        runtime_env: Ray runtime environment of the job (env_vars, pip, working_dir, ...); its env_vars are merged over
            the ones this run passes (PREFECT_API_URL of this run's API, PYTHONUNBUFFERED, ...).
        entrypoint: Another shell command to run as the job instead of `omniflow train ...`; empty for the training.
    """
    command = entrypoint or train_entrypoint(overrides, config_files)
    job_id = submit_ray_job(address, command, job_runtime_env(runtime_env, prefect_api_for_the_job(address)))
    outcome = follow_ray_job(address, job_id)
    if not outcome.succeeded:
        raise RayJobFailed(f"Ray job {job_id} ended {outcome.status}: {outcome.message}")
    return RayJobResult(job_id=job_id, status=outcome.status, entrypoint=command)
