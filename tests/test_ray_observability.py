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
    from omni_core.distributed.ray_cluster import dashboard_url

    url = dashboard_url()
    assert url and url.startswith("http://127.0.0.1:")
    assert f"Ray dashboard: {url}" in _flow_run_logs(state.state_details.flow_run_id)


def test_ray_task_and_actor_names_match_prefect_tasks_and_roles(flow_reference, ray_cluster):
    from ray.util.state import list_actors, list_tasks

    state, result, _ = flow_reference
    # The state API is asked about this session's cluster by address: other Ray clusters on the machine
    # (a run in a subprocess, another test session) would make its auto-detection refuse.
    address = ray_cluster.get_runtime_context().gcs_address
    actors = {
        a.name: a.class_name
        for a in list_actors(address=address, filters=[("name", "!=", "")], limit=10_000)
        if result.run_id in (a.name or "")
    }
    # The lean config runs verl's hybrid engine: the training actor is also the rollout worker (test_hybrid_engine);
    # the run's control actor holds a stop request (omni_core.distributed.run_control).
    assert actors == {
        f"omniflow-{result.run_id}-training-actor": "TrainingActor",
        f"omniflow-{result.run_id}-run-control": "RunControl",
    }
    # prefect-ray submits each Prefect task as a Ray task of the same name: one per epoch of this run. The
    # session's other runs share the cluster (and the Ray job), so this run's are told apart by time: each
    # Prefect task run `fit_epoch-<epoch>` of its fit subflow lies inside the Ray task that executed it.
    prefect_runs = _fit_epoch_task_runs(state.state_details.flow_run_id)
    assert sorted(r.name for r in prefect_runs) == ["fit_epoch-0", "fit_epoch-1"]
    ray_tasks = [
        t for t in list_tasks(address=address, filters=[("name", "=", "fit_epoch")], detail=True, limit=10_000) if t.end_time_ms
    ]
    matched = {}
    for run in prefect_runs:
        middle_ms = (run.start_time.timestamp() + run.end_time.timestamp()) / 2 * 1000
        (task,) = [t for t in ray_tasks if t.start_time_ms <= middle_ms <= t.end_time_ms]
        matched[run.name] = task
    assert len({t.task_id for t in matched.values()}) == 2
    assert {name: t.state for name, t in matched.items()} == {"fit_epoch-0": "FINISHED", "fit_epoch-1": "FINISHED"}
    # And no other fit_epoch ran on Ray while this run did (no retry, no stray submission).
    flow_run = _flow_run(state.state_details.flow_run_id)
    start_ms, end_ms = flow_run.start_time.timestamp() * 1000, flow_run.end_time.timestamp() * 1000
    during = {t.task_id for t in ray_tasks if start_ms <= t.start_time_ms <= end_ms}
    assert during == {t.task_id for t in matched.values()}


def _flow_run(flow_run_id):
    from prefect.client.orchestration import get_client

    async def read():
        async with get_client() as client:
            return await client.read_flow_run(flow_run_id)

    return asyncio.run(read())


def _fit_epoch_task_runs(flow_run_id) -> list:
    """The fit_epoch task runs of the run's `fit` subflow."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId

    async def read() -> list:
        async with get_client() as client:
            children = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
            )
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[c.id for c in children])))
        return [r for r in runs if r.name.startswith("fit_epoch-")]

    return asyncio.run(read())
