"""OmniFlow's Prefect deployments, defined once, in Python: what `omniflow serve` serves and `omniflow deploy`
registers on work pools (both through Prefect's own `RunnerDeployment`, with `flow.to_deployment`).

Two kinds:
- local deployments (`local_deployments`): served from one process by `omniflow serve`, or registered on a
  process work pool by `omniflow deploy` (default pool `omniflow-process`). `ray-job` among them only submits: the
  training runs as a Ray job on an existing cluster (a KubeRay RayCluster), its logs followed in the run;
- container deployments (`container_deployments`): the pipeline on a GPU, for a `docker` work pool (a
  container of the image the repository's Dockerfile builds, given every GPU of the host) and for a
  `kubernetes` work pool whose base job template is `examples/cluster/k8s-gpu-base-job-template.json`
  (a pod with `nvidia.com/gpu` limits and the shared volume of the KubeRay example). They run only where a
  worker of such a pool runs, so `omniflow deploy` registers them only when named, and `omniflow serve`
  refuses them.

Entrypoints are module paths (`omniflow.flows.main_diffusion_v1.main_diffusion_v1`): any machine or image
with `omniflow` installed runs them, with no flow code to download. Runs of these deployments import reward
files only from OmniFlow's examples/rewards and the folders in OMNIFLOW_ALLOWED_REWARD_DIRS (docs/security.md).
Parameters are typed (pydantic): the Prefect UI renders them as a form with defaults, descriptions and limits,
and rejects values that break the schema before a run is created.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefect.deployments.runner import RunnerDeployment

PROCESS_POOL = "omniflow-process"
DOCKER_POOL = "omniflow-docker"
KUBERNETES_POOL = "omniflow-kubernetes"
VERSION = "0.1.0"


def one_run_at_a_time(collision: str = "ENQUEUE") -> Any:
    """A deployment's `concurrency_limit`: one run at a time; a run triggered meanwhile waits in
    AwaitingConcurrencySlot (`ENQUEUE`) or is cancelled (`CANCEL_NEW`). Why each deployment has which: docs/deployments.md,
    "Concurrency, cancellation and library use"."""
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

    return ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy(collision))


# The image of the repository's Dockerfile, CUDA variant: `docker build --build-arg VARIANT=cuda -t omniflow:cuda .`
# on the host of the docker worker (or push it to a registry the worker can pull from and register with --image).
DOCKER_IMAGE = "omniflow:cuda"
# Work folder of that image (its WORKDIR): relative paths of the parameters (models/tiny-sd3, outputs/...) resolve
# there, on the named volume mounted over it, so the model and the checkpoints outlive each container.
DOCKER_WORKDIR = "/home/omniflow/work"
# The image a Kubernetes cluster pulls, and the shared volume of examples/cluster/kuberay-raycluster.yaml.
KUBERNETES_IMAGE = "registry.example.com/omniflow:cuda"
SHARED = "/mnt/shared"
# The job API of examples/cluster/kuberay-raycluster.yaml from inside the Kubernetes cluster: KubeRay's head service
# `<RayCluster name>-head-svc`, dashboard port 8265.
KUBERAY_DASHBOARD = "http://omniflow-head-svc:8265"


def docker_gpu_job_variables(image: str = DOCKER_IMAGE) -> dict[str, Any]:
    """Job variables of a `docker` work pool (Prefect's default base job template): every GPU of the host
    (docker's `--gpus all`, via docker-py's `device_requests`), a larger /dev/shm (Ray's object store and
    torch's data loaders use it; docker's default is 64 MB), and a named volume over the work folder."""
    return {
        "image": image,
        "image_pull_policy": "IfNotPresent",  # a locally built image is used as is; a registry image is pulled once
        "volumes": [f"omniflow-work:{DOCKER_WORKDIR}"],
        # Results on the volume too, so another container mounting it (or the host, under the volume's folder)
        # can read a run's TrainResult / PipelineResult.
        "env": {"PREFECT_RESULTS_LOCAL_STORAGE_PATH": f"{DOCKER_WORKDIR}/prefect-results", "RAY_USAGE_STATS_ENABLED": "0"},
        "container_create_kwargs": {
            "device_requests": [{"driver": "nvidia", "count": -1, "capabilities": [["gpu"]]}],
            "shm_size": "8g",
        },
        "auto_remove": True,
    }


def kubernetes_gpu_job_variables(image: str = KUBERNETES_IMAGE) -> dict[str, Any]:
    """Job variables of a `kubernetes` work pool created with examples/cluster/k8s-gpu-base-job-template.json
    (Prefect's default Kubernetes template plus `gpu_limit` and `shared_claim`): one GPU, the KubeRay example's
    ReadWriteMany claim at /mnt/shared (model, checkpoints and results there)."""
    return {
        "image": image,
        "namespace": "default",
        "gpu_limit": 1,
        "shared_claim": "omniflow-shared",
        "cpu_request": "8",
        "memory_request": "32Gi",
        "memory_limit": "32Gi",
        "finished_job_ttl": 86400,
        "env": {"PREFECT_RESULTS_LOCAL_STORAGE_PATH": f"{SHARED}/prefect-results", "RAY_USAGE_STATS_ENABLED": "0"},
    }


def local_deployments() -> list[RunnerDeployment]:
    """The deployments `omniflow serve` serves and `omniflow deploy` puts on a process work pool (no work pool
    here: `omniflow deploy` names it)."""
    from omniflow.flows.main_diffusion_v1 import main_diffusion_v1
    from omniflow.flows.pipeline import diffusion_rl_pipeline
    from omniflow.flows.procedural_geneval import procedural_geneval
    from omniflow.flows.ray_job import ray_job
    from prefect.deployments.runner import EntrypointType
    from prefect.schedules import Cron

    module = EntrypointType.MODULE_PATH
    return [
        main_diffusion_v1.to_deployment(
            name="tiny-sd3-nightly",
            description=(
                "Nightly Flow-GRPO fine-tune of the tiny SD3 recipe (make run's config). Every scheduled run trains "
                "a new experiment named tiny-sd3-nightly-<date>-<flow run name>, so it never resumes yesterday's. "
                "Needs models/tiny-sd3 (make run or `omniflow make-tiny-model models/tiny-sd3` builds it)."
            ),
            tags=["omniflow", "flow-grpo", "sd3", "tiny", "nightly"],
            version=VERSION,
            schedules=[Cron("0 3 * * *", timezone="UTC", active=True)],
            concurrency_limit=one_run_at_a_time("CANCEL_NEW"),
            parameters={
                "overrides": ["actor_rollout_ref.model.path=models/tiny-sd3", "trainer.experiment_name=tiny-sd3-nightly"],
                "new_experiment_per_run": True,
            },
            entrypoint_type=module,
        ),
        main_diffusion_v1.to_deployment(
            name="tiny-sd3-on-demand",
            description=(
                'Flow-GRPO fine-tune of the tiny SD3 recipe, run when triggered (UI "Custom run", `prefect deployment '
                "run`, or run_deployment from another flow). Set config fields in the form or verl-style key=value "
                "strings in `overrides`; the experiment resumes from its last checkpoint unless "
                "new_experiment_per_run is set."
            ),
            tags=["omniflow", "flow-grpo", "sd3", "tiny", "on-demand"],
            version=VERSION,
            concurrency_limit=one_run_at_a_time(),  # its runs resume one experiment: they queue
            parameters={
                "overrides": ["actor_rollout_ref.model.path=models/tiny-sd3", "trainer.experiment_name=tiny-sd3-on-demand"]
            },
            entrypoint_type=module,
        ),
        diffusion_rl_pipeline.to_deployment(
            name="tiny-sd3-pipeline",
            description=(
                "The whole ML pipeline on the tiny SD3 model: prepare the base model (built if missing) -> "
                "Flow-GRPO fine-tune (main_diffusion_v1 as a subflow) -> evaluate before/after at fixed seeds -> "
                "export in diffusers format."
            ),
            tags=["omniflow", "flow-grpo", "sd3", "tiny", "pipeline"],
            version=VERSION,
            concurrency_limit=one_run_at_a_time(),
            parameters={
                "base_model": "models/tiny-sd3",
                "build_tiny_if_missing": True,
                "overrides": ["trainer.experiment_name=tiny-sd3-pipeline"],
                "new_experiment_per_run": True,
            },
            entrypoint_type=module,
        ),
        procedural_geneval.to_deployment(
            name="procedural-geneval",
            description=(
                "Learning you can see on a laptop: pre-train a tiny pixel-space SD3 model on procedural scenes whose "
                'captions carry two designed biases ("on the left" drawn in the center, "blue square" drawn red) to its '
                "supervised plateau, then Flow-GRPO with the rule-based verifier reward (main_diffusion_v1 as a "
                "subflow) against the same wall time of more supervised training; evaluated at fixed seeds on seen "
                "and held-out combinations. Report artifact omniflow-procedural-geneval, result.json in the run folder."
            ),
            tags=["omniflow", "flow-grpo", "benchmark", "procedural-geneval", "pipeline"],
            version=VERSION,
            concurrency_limit=one_run_at_a_time(),
            parameters={"out_dir": "outputs/procedural-geneval", "seed": 0},
            entrypoint_type=module,
        ),
        ray_job.to_deployment(
            name="ray-job",
            description=(
                "Flow-GRPO fine-tune as a job on an existing Ray cluster (its dashboard's job API at `address`): the job "
                "runs `omniflow train <config_files> <overrides> ray_kwargs.ray_init.address=auto` on the cluster, "
                "reports to this Prefect API as a flow run of its own, and its log lines show in this run; cancelling "
                "this run stops the job. Paths are the cluster's (its shared volume); the defaults fit "
                "examples/cluster/kuberay-raycluster.yaml. Whoever can run this deployment runs code on that cluster."
            ),
            tags=["omniflow", "flow-grpo", "ray-job", "cluster"],
            version=VERSION,
            # no concurrency limit: runs of different experiments may share a cluster (one experiment's folder is
            # refused to a second run while one trains in it)
            parameters={
                "address": KUBERAY_DASHBOARD,
                "overrides": [
                    "trainer.device=cuda",
                    f"actor_rollout_ref.model.path={SHARED}/models/tiny-sd3",
                    "trainer.experiment_name=tiny-sd3-ray-job",
                    f"trainer.default_local_dir={SHARED}/omniflow/checkpoints/tiny-sd3-ray-job",
                ],
                "runtime_env": {"env_vars": {"PREFECT_RESULTS_LOCAL_STORAGE_PATH": f"{SHARED}/omniflow/prefect-results"}},
            },
            entrypoint_type=module,
        ),
    ]


def container_deployments(docker_image: str = DOCKER_IMAGE, kubernetes_image: str = KUBERNETES_IMAGE) -> list[RunnerDeployment]:
    """The pipeline on one machine's GPUs in a docker container, and on a GPU pod of a Kubernetes cluster."""
    from omniflow.flows.pipeline import diffusion_rl_pipeline
    from prefect.deployments.runner import EntrypointType

    common: dict[str, Any] = {"version": VERSION, "entrypoint_type": EntrypointType.MODULE_PATH}
    return [
        diffusion_rl_pipeline.to_deployment(
            name="tiny-sd3-pipeline-docker-gpu",
            description=(
                "The tiny SD3 pipeline on the GPUs of the docker worker's host, in a container of the OmniFlow image "
                "(Dockerfile, VARIANT=cuda). The model, checkpoints and results stay on the omniflow-work volume."
            ),
            tags=["omniflow", "flow-grpo", "sd3", "tiny", "pipeline", "docker", "gpu"],
            parameters={
                "base_model": "models/tiny-sd3",
                "build_tiny_if_missing": True,
                "overrides": ["trainer.device=cuda", "trainer.experiment_name=tiny-sd3-pipeline-docker"],
                "new_experiment_per_run": True,
            },
            work_pool_name=DOCKER_POOL,
            job_variables=docker_gpu_job_variables(docker_image),
            concurrency_limit=one_run_at_a_time(),
            **common,
        ),
        diffusion_rl_pipeline.to_deployment(
            name="tiny-sd3-pipeline-k8s-gpu",
            description=(
                "The tiny SD3 pipeline in a Kubernetes job with one nvidia.com/gpu, on the shared volume of the KubeRay "
                "example (pool template: examples/cluster/k8s-gpu-base-job-template.json)."
            ),
            tags=["omniflow", "flow-grpo", "sd3", "tiny", "pipeline", "kubernetes", "gpu"],
            parameters={
                "base_model": f"{SHARED}/models/tiny-sd3",
                "build_tiny_if_missing": True,
                "overrides": [
                    "trainer.device=cuda",
                    f"trainer.default_local_dir={SHARED}/checkpoints/tiny-sd3-pipeline-k8s",
                    "trainer.experiment_name=tiny-sd3-pipeline-k8s",
                ],
                "new_experiment_per_run": True,
            },
            work_pool_name=KUBERNETES_POOL,
            job_variables=kubernetes_gpu_job_variables(kubernetes_image),
            concurrency_limit=one_run_at_a_time(),
            **common,
        ),
    ]


def all_deployments(**images: str) -> list[RunnerDeployment]:
    return [*local_deployments(), *container_deployments(**images)]


class DeploymentChoiceError(ValueError):
    """A deployment name that is not defined, or not available to the command that was given it."""


def select(deployments: list[RunnerDeployment], names: list[str] | None) -> list[RunnerDeployment]:
    """`deployments`, or those named in `names`; an unknown name raises with the choices."""
    if not names:
        return deployments
    known = [d.name for d in deployments]
    missing = [n for n in names if n not in known]
    if missing:
        raise DeploymentChoiceError(f"no deployment named {missing}; choose from {known}")
    return [d for d in deployments if d.name in names]
