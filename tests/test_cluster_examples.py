"""The multi-node examples (`examples/cluster/`) are valid for the tools that read them, and agree with each
other: the Ray cluster-launcher YAML against the schema shipped in the installed ray package (and Ray's own
`prepare_config` + `validate_config`, what `ray up` runs), the KubeRay manifest against the fields the
ray.io/v1 RayCluster CRD requires (its schema ships with the operator, not with a Python package), and the
train script's real `omniflow train` command line against OmniFlow's config schema.

Both clusters: a head plus a GPU worker group, RAY_AUTH_MODE=token on every node, and one shared volume at
the path the train script puts the model and the checkpoints under. The KubeRay RayJob: `omniflow train` joined to
the job's own cluster, a CPU-only head, autoscaled GPU workers, PREFECT_API_URL on the driver's pod, the cluster
deleted after the job.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path

import yaml

CLUSTER = Path(__file__).resolve().parents[1] / "examples" / "cluster"
SCRIPT = CLUSTER / "omniflow-train.sh"
SHARED = "/mnt/shared"


def _train_command(*extra: str) -> list[str]:
    """The argv the train script passes to `omniflow train` (bash runs it with `omniflow` as a function that
    prints its arguments; PREFECT_API_URL set, so it starts no Prefect server)."""
    stub = 'omniflow() { [ "$1" = train ] && printf "%s\\n" "$@" || true; }; export -f omniflow; bash "$0" "$@"'
    env = {k: v for k, v in os.environ.items() if k not in ("SHARED", "MODEL_PATH", "EXPERIMENT")}
    env["PREFECT_API_URL"] = "http://127.0.0.1:9/api"
    out = subprocess.run(["bash", "-c", stub, str(SCRIPT), *extra], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_the_train_script_runs_omniflow_train_joined_to_the_cluster_with_everything_on_the_shared_volume():
    from omni_core.config import load_config

    argv = _train_command("trainer.total_epochs=3")
    assert argv[0] == "train", argv
    config = load_config(overrides=argv[1:])  # every key exists, every value has its type
    assert config.ray_kwargs.ray_init.address == "auto"
    assert config.trainer.device == "cuda" and config.trainer.total_epochs == 3  # extra arguments come last and win
    assert Path(config.actor_rollout_ref.model.path).is_relative_to(SHARED)
    assert config.trainer.checkpoint_dir.is_relative_to(SHARED) and config.trainer.checkpoint_dir.is_absolute()


def _all_node_env(pod_spec: dict) -> list[dict[str, dict]]:
    return [{e["name"]: e for e in c.get("env", [])} for c in pod_spec["containers"]]


def test_the_kuberay_manifest_is_a_ray_io_v1_raycluster_with_token_auth_gpus_and_a_shared_volume():
    docs = list(yaml.safe_load_all((CLUSTER / "kuberay-raycluster.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert sorted(kinds) == ["PersistentVolumeClaim", "RayCluster"]
    cluster, claim = kinds["RayCluster"], kinds["PersistentVolumeClaim"]
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["metadata"]["name"]
    assert claim["apiVersion"] == "v1" and claim["spec"]["accessModes"] == ["ReadWriteMany"]

    # The fields the RayCluster CRD (ray.io/v1) requires, and their types.
    spec = cluster["spec"]
    head = spec["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict) and isinstance(head["template"]["spec"]["containers"], list)
    assert all(isinstance(v, str) for v in head["rayStartParams"].values())  # a map of strings
    groups = spec["workerGroupSpecs"]
    for group in groups:
        assert {"groupName", "minReplicas", "maxReplicas", "rayStartParams", "template"} <= set(group), group
        assert 0 <= group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"]
    templates = [head["template"]["spec"]] + [g["template"]["spec"] for g in groups]
    for pod in templates:
        for container in pod["containers"]:
            assert container["name"] and container["image"], container

    # A GPU worker group, token auth on every Ray container, the shared claim at SHARED in every pod.
    assert any(int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1 for g in groups for c in g["template"]["spec"]["containers"])
    for pod in templates:
        for env in _all_node_env(pod):
            assert env["RAY_AUTH_MODE"]["value"] == "token", env
            assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "auth_token", env
        shared = {
            v["name"] for v in pod["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == claim["metadata"]["name"]
        }
        mounts = [m for c in pod["containers"] for m in c["volumeMounts"] if m["name"] in shared]
        assert [m["mountPath"] for m in mounts] == [SHARED] * len(pod["containers"]), pod
    # The header's steps run the train script from where the image puts the repository.
    assert "bash /opt/omniflow/examples/cluster/omniflow-train.sh" in (CLUSTER / "kuberay-raycluster.yaml").read_text()


def test_the_ray_cluster_launcher_yaml_passes_rays_schema_and_config_validation():
    import jsonschema
    import ray.autoscaler
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((CLUSTER / "ray-cluster.yaml").read_text())
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(raw, schema)  # the schema `ray up` checks (additional properties are errors)
    config = prepare_config(copy.deepcopy(raw))  # merged with Ray's AWS defaults, as `ray up` does
    validate_config(config)

    types = config["available_node_types"]
    assert config["head_node_type"] in types
    workers = [t for name, t in types.items() if name != config["head_node_type"]]
    assert workers and all(t["resources"].get("GPU", 0) >= 1 and t["max_workers"] >= t["min_workers"] >= 1 for t in workers)
    # Token auth: every node's `ray start` runs in token mode, with the token copied to it.
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    assert all("RAY_AUTH_MODE=token ray start" in c for c in starts if "ray start" in c), starts
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    # The shared volume at SHARED on every node (initialization_commands run on the head and the workers),
    # and the repository synced to ~/omniflow, where the header's `ray exec` finds the train script.
    assert any(f" {SHARED})" in c and "mount -t nfs4" in c for c in config["initialization_commands"])
    assert config["file_mounts"]["~/omniflow"] == "."
    assert "bash ~/omniflow/examples/cluster/omniflow-train.sh" in (CLUSTER / "ray-cluster.yaml").read_text()
    assert SCRIPT.is_file() and subprocess.run(["bash", "-n", str(SCRIPT)], timeout=30).returncode == 0


def test_the_kuberay_rayjob_runs_omniflow_train_on_a_cpu_head_and_autoscaled_gpu_workers_reporting_to_prefect():
    import shlex

    from omni_core.config import load_config

    (job,) = yaml.safe_load_all((CLUSTER / "kuberay-rayjob.yaml").read_text())
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob" and job["metadata"]["name"]
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] >= 0
    assert yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]["PYTHONUNBUFFERED"] == "1"

    # The entrypoint is `omniflow train` joined to the job's own cluster, every key valid, everything on the shared volume.
    argv = shlex.split(spec["entrypoint"])
    assert argv[:2] == ["omniflow", "train"], argv
    config = load_config(overrides=argv[2:])
    assert config.ray_kwargs.ray_init.address == "auto" and config.trainer.device == "cuda"
    assert Path(config.actor_rollout_ref.model.path).is_relative_to(SHARED)
    assert config.trainer.checkpoint_dir.is_relative_to(SHARED) and config.trainer.checkpoint_dir.is_absolute()

    cluster = spec["rayClusterSpec"]
    assert cluster["enableInTreeAutoscaling"] is True
    head, groups = cluster["headGroupSpec"], cluster["workerGroupSpecs"]
    assert all(isinstance(v, str) for v in head["rayStartParams"].values())  # a map of strings (the CRD)
    # A CPU-only head: CPUs declared for its own work, no GPU to Ray and none from Kubernetes.
    assert int(head["rayStartParams"]["num-cpus"]) >= 1 and head["rayStartParams"]["num-gpus"] == "0"
    head_pod = head["template"]["spec"]
    for container in head_pod["containers"]:
        assert not any("gpu" in k for part in container["resources"].values() for k in part), container["resources"]
    # GPU workers the autoscaler can add: min <= replicas < max.
    for group in groups:
        assert {"groupName", "minReplicas", "maxReplicas", "rayStartParams", "template"} <= set(group), group
        assert 0 <= group["minReplicas"] <= group["replicas"] < group["maxReplicas"], group
    assert all(int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1 for g in groups for c in g["template"]["spec"]["containers"])

    # The driver (on the head) reports to the Prefect API of a ConfigMap; token auth on every pod and the submitter.
    (head_env,) = _all_node_env(head_pod)
    assert head_env["PREFECT_API_URL"]["valueFrom"]["configMapKeyRef"]["key"], head_env
    pods = [head_pod, spec["submitterPodTemplate"]["spec"], *(g["template"]["spec"] for g in groups)]
    for pod in pods:
        for env in _all_node_env(pod):
            assert env["RAY_AUTH_MODE"]["value"] == "token", env
            assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "auth_token", env
    # The shared claim of kuberay-raycluster.yaml at SHARED in the cluster's pods.
    (claim,) = [
        d for d in yaml.safe_load_all((CLUSTER / "kuberay-raycluster.yaml").read_text()) if d["kind"] == "PersistentVolumeClaim"
    ]
    for pod in pods[:1] + pods[2:]:
        shared = {
            v["name"] for v in pod["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == claim["metadata"]["name"]
        }
        assert [m["mountPath"] for c in pod["containers"] for m in c["volumeMounts"] if m["name"] in shared] == [SHARED]
