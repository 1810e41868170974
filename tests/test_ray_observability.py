"""The Ray side of a run is observable: the dashboard's address is in the run's log, and Ray's task
and actor names match the Prefect task names and the workers' roles (Ray's state API, dashboard on)."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.timeout(600)


def _flow_run_logs(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async def read() -> list[str]:
        async with get_client() as client:
            logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        return [log.message for log in logs]

    return asyncio.run(read())


def test_dashboard_address_is_in_the_run_log(flow_reference, ray_cluster):
    state, _, _ = flow_reference
    from omni_core.ray_cluster import dashboard_url

    url = dashboard_url()
    assert url and url.startswith("http://127.0.0.1:")
    assert f"Ray dashboard: {url}" in _flow_run_logs(state.state_details.flow_run_id)


def test_ray_task_and_actor_names_match_prefect_tasks_and_roles(flow_reference, ray_cluster):
    from ray.util.state import list_actors, list_tasks

    _, result, _ = flow_reference
    actors = {
        a.name: a.class_name for a in list_actors(filters=[("name", "!=", "")], limit=10_000) if result.run_id in (a.name or "")
    }
    assert actors == {
        f"omniflow-{result.run_id}-training-actor": "TrainingActor",
        f"omniflow-{result.run_id}-rollout-worker-0": "RolloutWorker",
    }
    # prefect-ray submits each Prefect task as a Ray task of the same name: one per epoch here.
    fit_tasks = list_tasks(filters=[("name", "=", "fit_epoch")], limit=10_000)
    assert len({t.task_id for t in fit_tasks}) >= 2
    assert {t.state for t in fit_tasks} <= {"FINISHED", "FAILED"}
