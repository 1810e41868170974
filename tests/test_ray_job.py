"""Training as a Ray job (`flows/ray_job.py`, `omni_core/distributed/ray_job.py`) and the autoscaler request of a
joined cluster (`ray_cluster.request_run_resources`, `ray_kwargs.capacity_wait_s`), against one real `ray start
--head` with its dashboard (Ray's job API) and token auth, shared by the module (`tests/ray_heads.py`).

* The flow submits a job whose driver joins the cluster it runs on as `omniflow train` would
  (`ray_kwargs.ray_init.address=auto`, token auth, the capacity check) and prints what its runtime_env gave it;
  the job ends SUCCEEDED and its lines are in the flow run's logs, read back from the session's Prefect API. A job
  that exits 3 fails the flow with the job's status and message. (A whole training is left to test_multinode:
  here the entrypoint parameter keeps the job to seconds; the default entrypoint is checked as a string.)
* `omniflow ray-job` stopped with SIGTERM while its job runs: the job ends STOPPED and the command exits 130.
* A run joining the head with more CPUs in its budget than the head has, `ray_kwargs.capacity_wait_s=2`: its
  autoscaler request holds the run's bundles, and the run fails after about 2 s naming the key, its request
  withdrawn.
"""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

import pytest
from ray_heads import RayNode, ray_cluster

pytestmark = pytest.mark.timeout(300)

HEAD_CPUS = 4

# A job's driver as `omniflow train` starts: the config's Ray cluster joined (`connect_run_cluster`), then what the
# job's environment holds.
_JOINED = """
import os, sys
import ray
from omni_core.config import load_config
from omni_core.distributed.ray_cluster import connect_run_cluster

connect_run_cluster(load_config(overrides=sys.argv[1:]))
print("joined", ray.get_runtime_context().gcs_address, "cpus", int(ray.cluster_resources()["CPU"]), flush=True)
for name in ("PREFECT_API_URL", "OMNIFLOW_TEST_MARK", "RAY_AUTH_MODE"):
    print(name, os.environ.get(name), flush=True)
"""

# A run joining the head by address whose budget exceeds the head (9 CPUs of TransferQueue against 4).
_TOO_BIG = """
import json, sys, time
import ray
from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
from ray.autoscaler.v2.utils import is_autoscaler_v2
from ray.experimental.internal_kv import _internal_kv_get
from omni_core.config import ConfigError, load_config
from omni_core.distributed.ray_cluster import connect_ray, connect_run_cluster, request_run_resources
from omni_core.resources import autoscaler_bundles

def requested():
    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(raw) if raw else None

cfg = load_config(overrides=sys.argv[1:])
connect_ray(cfg)
assert not is_autoscaler_v2(), "the v1 request channel is read back here"
asked = request_run_resources(cfg)
out = {"bundles": autoscaler_bundles(cfg), "asked": asked, "requested": requested()}
start = time.monotonic()
try:
    connect_run_cluster(cfg)
except ConfigError as exc:
    out.update(error=str(exc), keys=exc.keys)
out.update(waited=time.monotonic() - start, after=requested())
print("RESULT=" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def head():
    with ray_cluster(RayNode(num_cpus=HEAD_CPUS), auth_mode="token", include_dashboard=True) as cluster:
        yield cluster


@pytest.fixture
def token(head, monkeypatch):
    """This process submits with the cluster's token, as a user with `RAY_AUTH_TOKEN` set does."""
    monkeypatch.setenv("RAY_AUTH_TOKEN", head.client_env["RAY_AUTH_TOKEN"])


def _python(script: str, *args: str) -> str:
    """A shell command running `script` with this interpreter (the job's shell has another PATH)."""
    return shlex.join([sys.executable, "-c", script, *args])


def _flow_run_logs(flow_run_id, done: Callable[[list[str]], bool], timeout_s: float = 60) -> list[str]:
    """The flow run's log messages once `done(messages)` holds (logs reach the API in batches; a job's line must be
    waited for as a whole message: the submit task's line quotes the entrypoint, which holds the same text)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200)
            messages = [log.message for log in logs]
            if done(messages) or time.monotonic() > deadline:
                return messages
            time.sleep(0.5)


def test_the_default_entrypoint_is_omniflow_train_joined_to_the_jobs_cluster_with_this_runs_api(monkeypatch):
    from omni_core.config import load_config
    from omni_core.distributed.ray_job import job_runtime_env, train_entrypoint

    command = train_entrypoint(["trainer.device=cuda", "trainer.experiment_name=a b"], ["/mnt/shared/run.yaml"])
    assert command == (
        "omniflow train /mnt/shared/run.yaml trainer.device=cuda 'trainer.experiment_name=a b' ray_kwargs.ray_init.address=auto"
    )
    argv = shlex.split(command)
    assert load_config(overrides=argv[3:]).ray_kwargs.ray_init.address == "auto"
    assert train_entrypoint(["ray_kwargs.ray_init.address=auto"]) == "omniflow train ray_kwargs.ray_init.address=auto"
    with pytest.raises(ValueError, match="joins the cluster the job runs on"):
        train_entrypoint(["ray_kwargs.ray_init.address=10.0.0.1:6379"])

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.delenv("PREFECT_API_KEY", raising=False)
    monkeypatch.delenv("PREFECT_API_AUTH_STRING", raising=False)
    env = job_runtime_env({"pip": ["x"], "env_vars": {"HF_HUB_OFFLINE": "0"}}, "http://prefect:4200/api")
    assert env == {
        "pip": ["x"],
        "env_vars": {
            "HF_HUB_OFFLINE": "0",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            "PREFECT_API_URL": "http://prefect:4200/api",
        },
    }  # the user's env_vars win; their other keys pass through


def test_the_ray_job_deployment_offers_the_form_a_ui_user_fills_in():
    from omniflow.deployments.definitions import KUBERAY_DASHBOARD, local_deployments

    from omni_core.config import load_config

    (dep,) = [d for d in local_deployments() if d.name == "ray-job"]
    assert dep.entrypoint == "omniflow.flows.ray_job.ray_job"
    assert {"address", "overrides", "config_files", "runtime_env"} <= set(dep._parameter_openapi_schema.properties)
    assert dep.parameters["address"] == KUBERAY_DASHBOARD
    assert load_config(overrides=dep.parameters["overrides"]).trainer.device == "cuda"


def test_a_job_runs_to_succeeded_and_its_lines_are_in_the_flow_runs_logs(head, token, prefect_api):
    from omniflow.flows.ray_job import ray_job

    mark = uuid.uuid4().hex
    overrides = ["trainer.device=cpu", "transfer_queue.backend.SimpleStorage.num_data_storage_units=1"]
    state = ray_job(
        address=head.dashboard_url,
        overrides=overrides,
        runtime_env={"env_vars": {"OMNIFLOW_TEST_MARK": mark}},
        entrypoint=_python(_JOINED, "ray_kwargs.ray_init.address=auto", *overrides),
        return_state=True,
    )
    assert state.is_completed(), state.message
    result = state.result()
    assert result.status == "SUCCEEDED" and result.job_id.startswith("omniflow-")
    # The head's GCS port (a job sees the node under its routable IP, this process under 127.0.0.1) and its CPUs.
    port = head.address.rsplit(":", 1)[1]
    expected = [f"PREFECT_API_URL {prefect_api}", f"OMNIFLOW_TEST_MARK {mark}", "RAY_AUTH_MODE token"]
    joined = f":{port} cpus {HEAD_CPUS}"

    def done(messages: list[str]) -> bool:
        return all(line in messages for line in expected) and any(m.endswith(joined) for m in messages)

    messages = _flow_run_logs(state.state_details.flow_run_id, done)
    for line in expected:
        assert line in messages, (line, "\n".join(messages))
    assert any(m.startswith("joined ") and m.endswith(f":{port} cpus {HEAD_CPUS}") for m in messages), messages


def test_a_job_that_fails_fails_the_flow_with_its_status_and_message(head, token, prefect_api):
    from omniflow.flows.ray_job import ray_job

    state = ray_job(
        address=head.dashboard_url,
        entrypoint=_python("import sys; print('about to fail', flush=True); sys.exit(3)"),
        return_state=True,
    )
    assert state.is_failed()
    assert "ended FAILED" in state.message and "exit code 3" in state.message, state.message
    assert "about to fail" in _flow_run_logs(state.state_details.flow_run_id, lambda messages: "about to fail" in messages)


def test_sigterm_to_omniflow_ray_job_stops_the_job_and_exits_130(head, token, prefect_api, tmp_path):
    from omni_core.distributed.ray_job import job_client, job_status

    mark = uuid.uuid4().hex
    entrypoint = _python(f"import time; print('started {mark}', flush=True); time.sleep(600)")
    env = {**head.client_env, "PYTHONUNBUFFERED": "1", "PREFECT_API_URL": prefect_api}
    log = tmp_path / "ray-job.log"
    cmd = [sys.executable, "-m", "omniflow.flows.cli", "ray-job", "--address", head.dashboard_url, "--entrypoint", entrypoint]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    try:
        client = job_client(head.dashboard_url)
        deadline, job_id = time.monotonic() + 120, None
        # RUNNING, and its line followed into the command's log
        while job_id is None or job_status(client, job_id) != "RUNNING" or f"started {mark}" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            job_id = next((j.submission_id for j in client.list_jobs() if mark in j.entrypoint), None)
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 130, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 30
    while (status := job_status(client, job_id)) not in ("STOPPED", "SUCCEEDED", "FAILED") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert status == "STOPPED", (status, log.read_text()[-3000:])


def test_a_joined_run_asks_the_autoscaler_for_its_bundles_and_gives_up_after_capacity_wait_s(head):
    overrides = [
        f"ray_kwargs.ray_init.address={head.address}",
        "ray_kwargs.capacity_wait_s=2",
        "trainer.device=cpu",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=8",
    ]
    out = subprocess.run(
        [sys.executable, "-c", _TOO_BIG, *overrides], capture_output=True, text=True, timeout=120, env=head.client_env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.rsplit("RESULT=", 1)[1])
    # TransferQueue's controller and 8 storage units, the training rank's bundle, the fit_epoch task: 11 CPUs,
    # the rank's bundle first as the placement group holds it.
    assert result["bundles"] == [{"CPU": 1.0}] * 11 and result["asked"] == result["bundles"]
    assert result["requested"] == result["bundles"]  # what the autoscaler reads
    assert result["keys"] == ["ray_kwargs.ray_init.num_cpus", "ray_kwargs.capacity_wait_s"], result
    assert "waited 2s" in result["error"] and f"declares {HEAD_CPUS} logical CPUs" in result["error"], result["error"]
    assert 2.0 <= result["waited"] < 10.0, result
    assert result["after"] == [], result  # withdrawn: the cluster may scale down again
