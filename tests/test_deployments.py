"""Deployments against real Prefect servers (`prefect server start` on 127.0.0.1, temporary PREFECT_HOME).

Two servers, started and stopped here, one per way of deploying the one definition (deployments/definitions.py):
- "served": `python -m omniflow.deployments.serve` serves its local deployments from one process;
- "pooled": `omniflow deploy` registers the same deployments on a process work pool and
  `prefect worker start --pool omniflow-process` runs what is triggered; the container deployments are
  registered on docker / kubernetes pools of Prefect's own templates (the server checks their job variables).

The runs are triggered through the API as the UI does (a flow run created from a deployment with
parameters), all at module set-up so that they run side by side; each test then waits for its own.
The browser test opens the served run's page in Debian chromium and keeps screenshots in its tmp_path.
No test needs another to run first: the one that stops `serve` waits for the runs it serves to end.
"""

from __future__ import annotations

import datetime
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    DeploymentFilter,
    DeploymentFilterId,
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterParentFlowRunId,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from real_prefect import (
    REPO,
    api,
    deployment,
    prefect_cli,
    prefect_command,
    server_env,
    start_process,
    stop_process,
    wait_final,
    wait_gone,
)

pytestmark = pytest.mark.timeout(600)

RUN_TIMEOUT_S = 420
# How long the served server's scheduler service may take to create the nightly deployment's runs.
SCHEDULER_WAIT_S = 180
FLOW = "main_diffusion_v1"
DEPLOYMENTS = {"tiny-sd3-nightly", "tiny-sd3-on-demand", "tiny-sd3-pipeline"}


@dataclass
class Stack:
    root: Path
    served_url: str
    pooled_url: str
    started: datetime.datetime  # before `serve` registered the deployments and their schedules
    deploy_output: Any = None
    serve: Any = None
    worker: Any = None
    runs: dict[str, Any] = field(default_factory=dict)


def _lean(flow_overrides: list[str], ckpt: Path, experiment: str) -> list[str]:
    return [
        *flow_overrides,
        "trainer.total_epochs=1",
        f"trainer.default_local_dir={ckpt}",
        f"trainer.experiment_name={experiment}",
    ]


def _wait_for_deployments(url: str, names: set[str], log: Path, timeout_s: float = 180) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    with api(url) as client:
        while time.monotonic() < deadline:
            if names <= {d.name for d in client.read_deployments()}:
                return
            time.sleep(1.0)
    raise AssertionError(f"deployments {names} did not appear; serve log:\n{log.read_text(errors='replace')[-3000:]}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, flow_overrides):
    from omniflow.flows.embedded_api import PrefectServer

    root = tmp_path_factory.mktemp("deployments")
    served, pooled = PrefectServer(root / "served-home"), PrefectServer(root / "pooled-home")
    served.start(), pooled.start()
    s = Stack(root, served.url, pooled.url, datetime.datetime.now(datetime.UTC))
    try:
        served.wait_ready(), pooled.wait_ready()
        served_env, pooled_env = server_env(served.url, served.home), server_env(pooled.url, pooled.home)
        s.serve = start_process([sys.executable, "-m", "omniflow.deployments.serve"], served_env, root, root / "serve.log")

        # The commands for work pools of docs/deployments.md, from a project folder (the worker's working directory).
        pool = prefect_cli(["work-pool", "create", "omniflow-process", "--type", "process"], pooled_env, root)
        assert pool.returncode == 0, pool.stdout + pool.stderr
        s.deploy_output = subprocess.run(
            [sys.executable, "-m", "omniflow.flows.cli", "deploy"],
            env=pooled_env,
            cwd=root,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert s.deploy_output.returncode == 0, s.deploy_output.stdout[-3000:] + s.deploy_output.stderr[-3000:]
        prefect = prefect_command()
        s.worker = start_process(
            [*prefect, "worker", "start", "--pool", "omniflow-process"], pooled_env, root, root / "worker.log"
        )

        _wait_for_deployments(served.url, DEPLOYMENTS, root / "serve.log")
        with api(served.url) as client:
            on_demand = deployment(client, FLOW, "tiny-sd3-on-demand")
            # Non-default parameters, as the UI's "Custom run" form sends them: typed config fields
            # plus verl-style overrides, and a new experiment per run.
            s.runs["served"] = client.create_flow_run_from_deployment(
                on_demand.id,
                parameters={
                    "config": {"trainer": {"project_name": "ui", "logger": ["console", "file"]}},
                    "overrides": _lean(flow_overrides, root / "served-ckpt", "ui-run"),
                    "new_experiment_per_run": True,
                },
            )
            # Passes the schema (positive ints) but breaks a cross-field rule of validate_config.
            s.runs["cross_field"] = client.create_flow_run_from_deployment(
                on_demand.id,
                parameters={
                    "config": {"data": {"train_batch_size": 3}, "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 2}}},
                    "overrides": [
                        o
                        for o in flow_overrides
                        if o.startswith(("actor_rollout_ref.model", "data.train_files", "data.val_files"))
                    ],
                },
            )
            # A reward file outside the folders `serve` allows (OMNIFLOW_ALLOWED_REWARD_DIRS unset: only
            # examples/rewards). A valid file, so that the folder is the only problem; importing it would leave a mark.
            outside = root / "outside-rewards"
            outside.mkdir()
            (outside / "reward.py").write_text(
                f"open({str(root / 'imported.mark')!r}, 'w').close()\n\n"
                "def compute_score(data_source, solution_image, ground_truth, extra_info):\n    return 0.0\n"
            )
            s.runs["reward_file"] = client.create_flow_run_from_deployment(
                on_demand.id,
                parameters={
                    "overrides": [
                        *_lean(flow_overrides, root / "reward-file-ckpt", "reward-file"),  # lean, were it not refused
                        f"reward.custom_reward_function.path={outside / 'reward.py'}",
                    ]
                },
            )
        with api(pooled.url) as client:
            s.runs["pooled"] = client.create_flow_run_from_deployment(
                deployment(client, FLOW, "tiny-sd3-on-demand").id,
                parameters={"overrides": _lean(flow_overrides, root / "pooled-ckpt", "pool-run")},
            )
        yield s
    finally:
        for proc in (s.serve, s.worker):
            if proc is not None and proc.poll() is None:
                stop_process(proc)
        served.stop(), pooled.stop()


# ----------------------------------------------------------------------------- serve path
def _next_3am_utc(after: datetime.datetime) -> datetime.datetime:
    """The first 03:00:00 UTC strictly after `after` (cron `0 3 * * *`, worked out by hand)."""
    at = after.astimezone(datetime.UTC).replace(hour=3, minute=0, second=0, microsecond=0)
    return at if at > after else at + datetime.timedelta(days=1)


def test_next_3am_utc_by_hand():
    utc = datetime.UTC
    assert _next_3am_utc(datetime.datetime(2025, 1, 1, 2, 59, 59, tzinfo=utc)) == datetime.datetime(2025, 1, 1, 3, tzinfo=utc)
    assert _next_3am_utc(datetime.datetime(2025, 1, 1, 3, 0, 0, tzinfo=utc)) == datetime.datetime(2025, 1, 2, 3, tzinfo=utc)
    assert _next_3am_utc(datetime.datetime(2025, 12, 31, 23, tzinfo=utc)) == datetime.datetime(2026, 1, 1, 3, tzinfo=utc)


def test_served_deployments_appear_with_their_schedule(stack):
    with api(stack.served_url) as client:
        deps = {d.name: d for d in client.read_deployments()}
        assert DEPLOYMENTS <= deps.keys()
        nightly = deps["tiny-sd3-nightly"]
        assert [s.schedule.cron for s in nightly.schedules] == ["0 3 * * *"] and nightly.schedules[0].active
        assert nightly.parameters["new_experiment_per_run"] is True
        assert "nightly" in nightly.tags and nightly.description.startswith("Nightly Flow-GRPO")
        # The server's scheduler service creates the runs on its own loop (recent deployments every 5 s): on a busy
        # machine that can come after the deployments appear, so the test polls with a deadline.
        deadline, scheduled = time.monotonic() + SCHEDULER_WAIT_S, []
        while not scheduled and time.monotonic() < deadline:
            scheduled = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[nightly.id])),
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=["SCHEDULED"]))),
            )
            if not scheduled:
                time.sleep(1.0)
    starts = sorted(r.expected_start_time.astimezone(datetime.UTC) for r in scheduled)
    assert starts, "the cron deployment has no scheduled run"
    # Every scheduled run is at 03:00:00 UTC, on consecutive days ...
    assert all((t.hour, t.minute, t.second, t.microsecond) == (3, 0, 0, 0) for t in starts), starts
    assert all(b - a == datetime.timedelta(days=1) for a, b in zip(starts, starts[1:], strict=False)), starts
    # ... from the first 03:00 after the schedule was created; the day after that where the 03:00 in between had
    # already passed when the scheduler ran, or its run had left the SCHEDULED state (the module ran across 03:00).
    first = _next_3am_utc(stack.started)
    assert starts[0] in (first, first + datetime.timedelta(days=1)), (stack.started, starts)


def test_on_demand_run_with_ui_parameters_completes_with_artifacts(stack):
    run = wait_final(stack.served_url, stack.runs["served"].id, RUN_TIMEOUT_S, stack.root / "serve.log")
    assert run.state.type.value == "COMPLETED", run.state.message
    assert run.parameters["new_experiment_per_run"] is True
    # Its own experiment: <name>-<scheduled start>-<flow run name>, in a subfolder of default_local_dir.
    stamp = f"{run.expected_start_time.astimezone(datetime.UTC):%Y%m%d-%H%M%S}-{run.name}"
    ckpt = stack.root / "served-ckpt" / f"ui-run-{stamp}"
    assert (ckpt / "global_step_1" / "actor" / "model.safetensors").is_file()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"

    with api(stack.served_url) as client:
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id]))
        )
        ids = [run.id, *(c.id for c in children)]
        keys = {
            a.key for a in client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=ids)))
        }
    assert {
        "omniflow-epoch-metrics",
        "omniflow-checkpoint",
        "omniflow-progress",
        "omniflow-validation",
        "omniflow-reward-curve",
        "omniflow-run-summary",
    } <= keys


# ----------------------------------------------------------------------------- bad parameters
def test_schema_violation_is_rejected_by_the_api_naming_the_field(stack):
    from prefect.exceptions import PrefectHTTPStatusError

    with api(stack.served_url) as client:
        dep = deployment(client, FLOW, "tiny-sd3-on-demand")
        before = len(client.read_flow_runs())
        with pytest.raises(PrefectHTTPStatusError) as err:
            client.create_flow_run_from_deployment(dep.id, parameters={"config": {"data": {"train_batch_size": 0}}})
        after = len(client.read_flow_runs())
    message = str(err.value)
    assert "config.data.train_batch_size" in message and "minimum" in message, message
    assert after == before  # no run was created


def test_cross_field_violation_fails_the_run_before_any_ray_worker(stack):
    run = wait_final(stack.served_url, stack.runs["cross_field"].id, RUN_TIMEOUT_S, stack.root / "serve.log")
    assert run.state.type.value == "FAILED"
    assert "data.train_batch_size=3: must be divisible by actor_rollout_ref.actor.ppo_mini_batch_size=2" in run.state.message
    with api(stack.served_url) as client:
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    # Only the first stage ran: no init_transfer_queue, so no Ray cluster, TransferQueue or actor.
    assert [(t.name.rsplit("-", 1)[0], t.state.name) for t in tasks] == [("validate_config", "Failed")]


def test_a_deployment_run_refuses_a_reward_file_outside_the_allowed_folders_before_any_ray_worker(stack):
    """A run triggered through the API may not import a reward file from anywhere (it is code the run executes): the
    run ends Failed naming the key and the variable that allows a folder, in validate_config, and never imports it."""
    from omni_core.validation.rewards import ALLOWED_REWARD_DIRS_ENV

    run = wait_final(stack.served_url, stack.runs["reward_file"].id, RUN_TIMEOUT_S, stack.root / "serve.log")
    assert run.state.type.value == "FAILED", run.state.message
    message = run.state.message or ""
    assert f"reward.custom_reward_function.path={stack.root / 'outside-rewards' / 'reward.py'}" in message, message
    assert ALLOWED_REWARD_DIRS_ENV in message and "a run started through a deployment imports reward files only" in message
    with api(stack.served_url) as client:
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    assert [(t.name.rsplit("-", 1)[0], t.state.name) for t in tasks] == [("validate_config", "Failed")]
    assert not (stack.root / "imported.mark").exists()  # parsed to check it, never imported


# ----------------------------------------------------------------------------- work pool path
def test_omniflow_deploy_registers_schedules_and_parameter_schema(stack):
    assert "tiny-sd3-nightly" in stack.deploy_output.stdout
    with api(stack.pooled_url) as client:
        deps = {d.name: d for d in client.read_deployments()}
    assert DEPLOYMENTS <= deps.keys()
    nightly, on_demand = deps["tiny-sd3-nightly"], deps["tiny-sd3-on-demand"]
    assert [s.schedule.cron for s in nightly.schedules] == ["0 3 * * *"] and on_demand.schedules == []
    assert {d.work_pool_name for d in deps.values()} == {"omniflow-process"}
    schema = on_demand.parameter_openapi_schema
    assert set(schema["properties"]) == {"config", "overrides", "config_files", "new_experiment_per_run"}
    # The UI form: the config's fields with their defaults, descriptions (the YAML comments) and limits.
    batch = schema["definitions"]["DataConfig"]["properties"]["train_batch_size"]
    assert batch["default"] == 2 and batch["exclusiveMinimum"] == 0 and "prompts" in batch["description"].lower()
    assert "new experiment" in schema["properties"]["new_experiment_per_run"].get("description", "")
    # The pipeline is deployable too, with its own typed form.
    pipeline = deps["tiny-sd3-pipeline"].parameter_openapi_schema["properties"]
    assert pipeline["eval_samples_per_prompt"]["minimum"] == 1 and pipeline["base_model"]["default"] == "models/tiny-sd3"


def test_process_worker_runs_a_triggered_run(stack):
    run = wait_final(stack.pooled_url, stack.runs["pooled"].id, RUN_TIMEOUT_S, stack.root / "worker.log")
    assert run.state.type.value == "COMPLETED", run.state.message
    assert run.work_pool_name == "omniflow-process"
    assert (stack.root / "pooled-ckpt" / "global_step_1" / "actor" / "model.safetensors").is_file()


def test_served_and_pooled_deployments_come_from_one_definition(stack):
    fields = ("description", "tags", "version", "parameters", "entrypoint", "parameter_openapi_schema")
    with api(stack.served_url) as client:
        served = {d.name: d for d in client.read_deployments() if d.name in DEPLOYMENTS}
    with api(stack.pooled_url) as client:
        pooled = {d.name: d for d in client.read_deployments() if d.name in DEPLOYMENTS}
    for name in DEPLOYMENTS:
        a, b = served[name], pooled[name]
        assert {f: getattr(a, f) for f in fields} == {f: getattr(b, f) for f in fields}, name
        assert [s.schedule for s in a.schedules] == [s.schedule for s in b.schedules]
        assert a.entrypoint.startswith("omniflow.flows.")  # a module path: any machine with omniflow installed runs it
        assert a.work_pool_name is None and b.work_pool_name == "omniflow-process"
        # The pooled runs start in the folder `omniflow deploy` ran from, where relative paths resolve.
        assert b.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(stack.root.resolve())}}]


def test_container_deployments_register_on_pools_of_prefects_own_templates(stack):
    """The docker pool has prefect-docker's default template, the kubernetes pool the example's; the server checks
    the templates (pool creation) and the deployments' job variables against them (deployment creation)."""
    import json

    from omniflow.deployments.deploy import chosen_deployments, deploy_deployments
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import PrefectHTTPStatusError
    from prefect_docker.worker import DockerWorker

    names = ["tiny-sd3-pipeline-docker-gpu", "tiny-sd3-pipeline-k8s-gpu"]
    with api(stack.pooled_url) as client:
        by_pool = chosen_deployments(names)
        assert sorted(by_pool) == ["omniflow-docker", "omniflow-kubernetes"]
        with pytest.raises(ValueError, match="prefect work-pool create omniflow-docker --type docker"):
            deploy_deployments(by_pool)  # no such pools yet: the error says how to create them
        client.create_work_pool(
            WorkPoolCreate(name="omniflow-docker", type="docker", base_job_template=DockerWorker.get_default_base_job_template())
        )
        k8s_template = json.loads((REPO / "examples" / "cluster" / "k8s-gpu-base-job-template.json").read_text())
        client.create_work_pool(WorkPoolCreate(name="omniflow-kubernetes", type="kubernetes", base_job_template=k8s_template))
        assert deploy_deployments(by_pool) == [
            "diffusion-rl-pipeline/tiny-sd3-pipeline-docker-gpu -> omniflow-docker",
            "diffusion-rl-pipeline/tiny-sd3-pipeline-k8s-gpu -> omniflow-kubernetes",
        ]
        docker = deployment(client, "diffusion-rl-pipeline", "tiny-sd3-pipeline-docker-gpu")
        k8s = deployment(client, "diffusion-rl-pipeline", "tiny-sd3-pipeline-k8s-gpu")
        assert docker.job_variables["container_create_kwargs"]["device_requests"][0]["capabilities"] == [["gpu"]]
        assert k8s.job_variables["gpu_limit"] == 1 and k8s.work_pool_name == "omniflow-kubernetes"
        assert docker.pull_steps == [] and k8s.pull_steps == []  # the code is in the image
        # The server enforces the pool's schema: a GPU count that is not an integer is refused.
        (bad,) = chosen_deployments(["tiny-sd3-pipeline-k8s-gpu"])["omniflow-kubernetes"]
        bad.job_variables["gpu_limit"] = "one"
        with pytest.raises(PrefectHTTPStatusError) as refused:
            bad.apply(work_pool_name="omniflow-kubernetes")
        assert "is not of type" in str(refused.value) and "integer" in str(refused.value), refused.value


# ----------------------------------------------------------------------------- the UI, in a browser
# func_only: the apt install of chromium (browser's fixture, bounded on its own) does not count against the test.
@pytest.mark.timeout(600, func_only=True)
def test_run_page_in_the_prefect_ui_shows_tasks_and_artifacts(stack, browser, tmp_path):
    from browser import open_tab, screenshot_dir, wait_for_text

    run = wait_final(stack.served_url, stack.runs["served"].id, RUN_TIMEOUT_S, stack.root / "serve.log")
    with api(stack.served_url) as client:
        (fit,) = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id]))
        )
    ui = stack.served_url.removesuffix("/api")
    shots = screenshot_dir(tmp_path)

    # The run's page: name, state, deployment; its Task Runs tab lists the stages.
    browser.get(f"{ui}/runs/flow-run/{run.id}")
    body = wait_for_text(browser, [run.name, "Completed", "tiny-sd3-on-demand", "Task Runs"])
    assert "Can't connect to Server API" not in body
    open_tab(browser, "Task Runs")
    stages = [
        "validate_config",
        "init_transfer_queue",
        "build_trainer",
        "init_trainer",
        "init_agent_loop",
        "close_transfer_queue",
    ]
    wait_for_text(browser, [f"{name}-" for name in stages])
    browser.save_screenshot(str(shots / "flow_run_page.png"))

    # The run's own artifacts tab: the summary, whose verdict says whether the reward went up.
    open_tab(browser, "Artifacts")
    wait_for_text(browser, ["omniflow-run-summary", "mean reward"])

    # The fit subflow's artifacts tab: the per-epoch artifacts with their titles.
    browser.get(f"{ui}/runs/flow-run/{fit.id}")
    wait_for_text(browser, [fit.name, "Parent Run", run.name])
    open_tab(browser, "Artifacts")
    wait_for_text(
        browser,
        [
            "omniflow-progress",
            "omniflow-epoch-metrics",
            "Metrics of epoch 0, one row per step",
            "omniflow-checkpoint",
            "omniflow-reward-curve",
        ],
    )
    browser.save_screenshot(str(shots / "fit_artifacts_tab.png"))

    # The summary artifact's page shows its pictures (data-URI PNGs rendered by the UI's markdown).
    with api(stack.served_url) as client:
        (summary,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]), key={"any_": ["omniflow-run-summary"]}
            )
        )
    browser.get(f"{ui}/artifacts/artifact/{summary.id}")
    wait_for_text(browser, ["mean reward", "Steps trained: 1"])
    images = _wait_for_images(browser)
    assert sorted(images) == [36, 640], images  # the 1-prompt validation grid (32 px + padding), the reward curve
    browser.save_screenshot(str(shots / "run_summary_artifact.png"))
    for name in ("flow_run_page.png", "fit_artifacts_tab.png", "run_summary_artifact.png"):
        assert (shots / name).stat().st_size > 10_000


def _wait_for_images(driver, timeout_s: float = 30) -> list[int]:
    """naturalWidth of each loaded data-URI <img> on the page (0 would mean the browser could not decode it)."""
    import time

    script = (
        "return [...document.images].filter(i => i.src.startsWith('data:image/png')).map(i => i.complete ? i.naturalWidth : 0)"
    )
    deadline = time.monotonic() + timeout_s
    widths: list[int] = []
    while time.monotonic() < deadline:
        widths = driver.execute_script(script)
        if widths and all(widths):
            return widths
        time.sleep(0.5)
    return widths


# ----------------------------------------------------------------------------- stopping serve
def test_stopping_serve_leaves_the_deployments_active(stack):
    import psutil

    # The runs this serve process executes end first, so that no other test depends on running before this one.
    for name in ("served", "cross_field", "reward_file"):
        wait_final(stack.served_url, stack.runs[name].id, RUN_TIMEOUT_S, stack.root / "serve.log")
    serve = psutil.Process(stack.serve.pid)
    tree = [serve, *serve.children(recursive=True)]

    code = stop_process(stack.serve)
    log = (stack.root / "serve.log").read_text(errors="replace")
    # SIGTERM is a clean stop: Prefect's runner shuts down gracefully and `omniflow serve` exits 0.
    assert code == 0, log[-3000:]
    assert "SIGTERM received, initiating graceful shutdown" in log, log[-3000:]
    wait_gone(tree, timeout_s=60)  # the process and its children

    with api(stack.served_url) as client:
        deps = {d.name: d for d in client.read_deployments()}
    assert DEPLOYMENTS <= deps.keys()
    assert not [d.name for d in deps.values() if d.paused]
    assert deps["tiny-sd3-nightly"].schedules and all(s.active for s in deps["tiny-sd3-nightly"].schedules)
