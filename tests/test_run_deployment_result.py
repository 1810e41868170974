"""A parent flow in another process reads a served deployment's typed result through `run_deployment`.

A real `prefect server start`, `omniflow serve tiny-sd3-on-demand` in a subprocess, and a parent flow in a third
process whose script imports only prefect (as the README's example does): `run_deployment(...)` returns the
finished run, and `state.result()` gives the `TrainResult` the served run persisted as JSON, read from the
absolute path the run wrote (the parent has its own PREFECT_HOME). A fourth process, where OmniFlow cannot be
imported (a machine without it), gets the same fields as a plain dict.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from real_prefect import api, server_env, start_process, stop_process

pytestmark = pytest.mark.timeout(600)

FLOW, NAME = "main_diffusion_v1", "tiny-sd3-on-demand"

# The parent: prefect only. It prints which OmniFlow modules it had imported before reading the result (none),
# then the result's type and fields as JSON.
PARENT = textwrap.dedent(
    """
    import json, sys
    from prefect import flow
    from prefect.deployments import run_deployment

    @flow(name="nightly-ml-pipeline")
    def parent(parameters: dict, timeout: float) -> None:
        run = run_deployment(name="main_diffusion_v1/tiny-sd3-on-demand", parameters=parameters, timeout=timeout)
        if not run.state.is_completed():
            raise RuntimeError(f"fine-tune {run.name}: {run.state.message}")
        before = sorted(m for m in sys.modules if m.split(".")[0] in ("omniflow", "omni_core"))
        result = run.state.result()
        print("RESULT=" + json.dumps({
            "flow_run_id": str(run.id),
            "parent_task_run_id": str(run.parent_task_run_id),
            "omniflow_modules_before_result": before,
            "type": type(result).__name__,
            "result": result.model_dump(mode="json"),
        }), flush=True)

    parent(parameters=json.loads(sys.argv[1]), timeout=float(sys.argv[2]))
    """
)

# A process where OmniFlow is not importable reads the same run's result: Prefect's JSON decoder then returns the
# stored {"__class__": ..., "data": {...}} as it is.
READER_WITHOUT_OMNIFLOW = textwrap.dedent(
    """
    import importlib.abc, json, sys

    class NoOmniFlow(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("omniflow", "omni_core"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoOmniFlow())
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        result = client.read_flow_run(sys.argv[1]).state.result()
    print("RESULT=" + json.dumps(result), flush=True)
    """
)


def _result_line(out: subprocess.CompletedProcess) -> dict:
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT=")]
    assert out.returncode == 0 and lines, f"exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return json.loads(lines[-1].removeprefix("RESULT="))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from omniflow.flows.embedded_api import PrefectServer

    root = tmp_path_factory.mktemp("run_deployment")
    server = PrefectServer(root / "server-home")
    server.start()
    serve = None
    try:
        server.wait_ready()
        env = server_env(server.url, server.home)
        serve = start_process([sys.executable, "-m", "omniflow.deployments.serve", NAME], env, root, root / "serve.log")
        deadline = time.monotonic() + 180
        with api(server.url) as client:
            while NAME not in {d.name for d in client.read_deployments()}:
                assert time.monotonic() < deadline and serve.poll() is None, (root / "serve.log").read_text(errors="replace")
                time.sleep(1.0)
        yield root, server.url
    finally:
        if serve is not None and serve.poll() is None:
            stop_process(serve)
        server.stop()


def test_a_parent_flow_in_another_process_reads_the_train_result_of_a_served_run(served, flow_overrides):
    root, url = served
    ckpt = root / "ckpt"
    parameters = {
        "overrides": [
            *flow_overrides,
            "trainer.total_epochs=1",
            "trainer.val_before_train=false",
            f"trainer.default_local_dir={ckpt}",
            "trainer.experiment_name=from-parent",
        ]
    }
    (root / "parent.py").write_text(PARENT)
    # The parent's own PREFECT_HOME: it reads the result where the served run wrote it, not in its own storage.
    parent_env = server_env(url, root / "parent-home")
    out = subprocess.run(
        [sys.executable, str(root / "parent.py"), json.dumps(parameters), "420"],
        env=parent_env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=480,
    )
    got = _result_line(out)
    assert got["omniflow_modules_before_result"] == []  # the parent script itself imports no OmniFlow module
    assert got["type"] == "TrainResult"  # Prefect's JSON decoder rebuilt the pydantic model
    result = got["result"]
    assert result["global_step"] == 1
    assert Path(result["final_checkpoint"]).is_dir() and Path(result["final_checkpoint"]).name == "global_step_1"
    assert (Path(result["final_checkpoint"]) / "actor" / "model.safetensors").is_file()
    assert Path(result["checkpoint_dir"]) == ckpt
    assert got["parent_task_run_id"] != "None"  # run_deployment made the run a subflow of the parent

    (root / "reader.py").write_text(READER_WITHOUT_OMNIFLOW)
    out = subprocess.run(
        [sys.executable, str(root / "reader.py"), got["flow_run_id"]],
        env=server_env(url, root / "reader-home"),
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    plain = _result_line(out)
    assert plain["__class__"] == "omniflow.flows.main_diffusion_v1.TrainResult"
    assert plain["data"] == result


def test_pipeline_result_round_trips_through_prefects_json_serializer():
    """The pipeline's PipelineResult (with its nested TrainResult) comes back as the model from the JSON the flow
    persists (its end-to-end run is test_pipeline's; this checks the serializer the decorator names)."""
    from omniflow.flows.main_diffusion_v1 import TrainResult, main_diffusion_v1
    from omniflow.flows.pipeline import PipelineResult, diffusion_rl_pipeline
    from prefect.serializers import JSONSerializer

    for flow in (main_diffusion_v1, diffusion_rl_pipeline):
        assert flow.persist_result is True and flow.result_serializer == "json"
    train = TrainResult(
        run_id="r",
        final_checkpoint="/c/global_step_2",
        global_step=2,
        final_metrics={"critic/rewards/mean": 0.25},
        reward_first=0.125,
        reward_last=0.25,
        checkpoint_dir="/c",
        log_dir="/l",
    )
    piped = PipelineResult(
        base_model="models/tiny-sd3",
        train=train,
        reward_before=0.125,
        reward_after=0.25,
        grid_before="before.png",
        grid_after="after.png",
        export_dir="export",
        export_kind="full",
    )
    back = JSONSerializer().loads(JSONSerializer().dumps(piped))
    assert isinstance(back, PipelineResult) and isinstance(back.train, TrainResult) and back == piped
