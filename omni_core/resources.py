"""The Ray resources one run reserves, computed in one place.

`validate_config` compares this budget with what a local cluster will declare
(`ray_kwargs.ray_init.num_cpus`), and `check_cluster_resources` compares it with what the running
cluster has, before anything is submitted: Ray leaves a reservation that cannot be met pending
forever (docs/design.md section 7). The actors and tasks that make up the budget take their reservations
from the constants here, so the budget cannot drift from what is asked for.

Light on purpose (no torch, no Ray): `omniflow validate` imports it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

# Logical CPUs each part of a run reserves for its lifetime. TransferQueue's controller and each of its
# SimpleStorage units are `@ray.remote(num_cpus=1)` in the transfer_queue package.
TQ_CONTROLLER_CPUS = 1
TQ_STORAGE_UNIT_CPUS = 1
TRAINING_ACTOR_CPUS = 1
ROLLOUT_WORKER_CPUS = 1
# prefect-ray runs each `fit_epoch` task as a Ray task with Ray's default reservation of one CPU.
FIT_EPOCH_TASK_CPUS = 1


# `transfer_queue.backend.SimpleStorage.num_data_storage_units: null`: one unit per this many logical CPUs of the
# machine that starts the run, at least 1 (each unit is a process with torch: ~280 MB on a small machine) and
# at most verl-omni's default of 8.
CPUS_PER_STORAGE_UNIT = 16
MAX_AUTO_STORAGE_UNITS = 8


def auto_storage_units(cpus: int | None = None) -> int:
    """Storage units for `num_data_storage_units: null`: one per `CPUS_PER_STORAGE_UNIT` logical CPUs (`cpus`,
    default this machine's `os.cpu_count()`), between 1 and `MAX_AUTO_STORAGE_UNITS`."""
    cpus = cpus if cpus is not None else os.cpu_count() or 1
    return min(MAX_AUTO_STORAGE_UNITS, max(1, cpus // CPUS_PER_STORAGE_UNIT))


def storage_unit_count(config: Any) -> int:
    """TransferQueue's SimpleStorage units of `config` (an `OmniFlowConfig`): as configured, or `auto_storage_units`."""
    units = config.transfer_queue.backend.SimpleStorage.num_data_storage_units
    return auto_storage_units() if units is None else units


@dataclass(frozen=True)
class ResourceBudget:
    """Logical CPUs by role, and the GPUs the run needs from the cluster."""

    cpus: dict[str, int]
    gpus: int

    @property
    def total_cpus(self) -> int:
        return sum(self.cpus.values())

    def describe_cpus(self) -> str:
        """`transfer_queue 3, training_actor 1, ...`: what an error message shows."""
        return ", ".join(f"{role} {n}" for role, n in self.cpus.items())


def standalone_rollout(config: Any) -> bool:
    """separate_async: the rollout workers have devices of their own (not colocated with the training ranks)."""
    return config.trainer.v1.trainer_mode == "separate_async"


def offline_samples(config: Any) -> bool:
    """`algorithm.sample_source=offline`: the training samples come from a data set (offline Diffusion-DPO's pairs), so
    the run has no rollout workers."""
    return config.algorithm.sample_source == "offline"


def training_rank_count(config: Any) -> int:
    """`trainer.n_gpus_per_node x trainer.nnodes`: the data-parallel training ranks."""
    return config.trainer.n_gpus_per_node * config.trainer.nnodes


def hybrid_engine_obstacles(config: Any) -> list[tuple[str, str]]:
    """Why the rollout of `config` cannot run inside the training ranks (verl's hybrid engine), as `(key, reason)`
    pairs; empty when it can. One rollout worker per rank, in that rank's process, taking turns with its update."""
    out: list[tuple[str, str]] = []
    if offline_samples(config):
        return [("algorithm.sample_source", "offline samples come from a data set: the run has no rollout to run")]
    if standalone_rollout(config):
        out.append(("trainer.v1.trainer_mode", "separate_async samples on devices of its own while the ranks train"))
    workers, ranks = config.actor_rollout_ref.rollout.agent.num_workers, training_rank_count(config)
    if not standalone_rollout(config) and workers != ranks:
        out.append(
            (
                "actor_rollout_ref.rollout.agent.num_workers",
                f"the hybrid engine runs one rollout worker in each of the {ranks} training rank(s), not {workers}",
            )
        )
    if config.actor_rollout_ref.actor.strategy == "fsdp2":
        out.append(("actor_rollout_ref.actor.strategy", "fsdp2 ranks hold shards, and a rollout needs whole weights"))
    return out


def uses_hybrid_engine(config: Any) -> bool:
    """`actor_rollout_ref.hybrid_engine` resolved: as set, or (null) on wherever `hybrid_engine_obstacles` finds none.
    Validation refuses `true` with an obstacle."""
    setting = config.actor_rollout_ref.hybrid_engine
    return bool(setting) if setting is not None else not hybrid_engine_obstacles(config)


def separate_rollout_worker_count(config: Any) -> int:
    """Rollout workers that are Ray actors of their own: none under the hybrid engine (they are the training
    ranks' processes), else `rollout_worker_count`."""
    return 0 if uses_hybrid_engine(config) else rollout_worker_count(config)


def rollout_worker_count(config: Any) -> int:
    """sync: `rollout.agent.num_workers`, colocated; separate_async: one worker per device of the standalone
    pool, `rollout.nnodes x rollout.n_gpus_per_node` (on cpu: processes); none with offline samples."""
    rollout = config.actor_rollout_ref.rollout
    if offline_samples(config):
        return 0
    if standalone_rollout(config):
        return rollout.nnodes * rollout.n_gpus_per_node
    return rollout.agent.num_workers


def run_resource_budget(config: Any) -> ResourceBudget:
    """What a run of `config` (an `OmniFlowConfig`) reserves on its Ray cluster."""
    units = storage_unit_count(config)
    workers = separate_rollout_worker_count(config)
    trainer = config.trainer
    cpus = {
        "transfer_queue": TQ_CONTROLLER_CPUS + TQ_STORAGE_UNIT_CPUS * units,
        "training_actor": TRAINING_ACTOR_CPUS * trainer.n_gpus_per_node * trainer.nnodes,  # one per rank
        "rollout_workers": ROLLOUT_WORKER_CPUS * workers,
        "fit_epoch_task": FIT_EPOCH_TASK_CPUS,
    }
    ranks = trainer.n_gpus_per_node * trainer.nnodes
    gpus = ranks + (workers if standalone_rollout(config) else 0) if trainer.device == "cuda" else 0
    return ResourceBudget(cpus=cpus, gpus=gpus)


# ------------------------------------------------------------------------------------ GPU slots
AUTO_GPU_LIMIT = "auto"  # trainer.concurrency.gpu_limit: one limit per host (local cluster) or per joined Ray cluster
_LIMIT_NAME_FORBIDDEN = "/%&><"  # characters a Prefect global concurrency limit's name may not hold


@dataclass(frozen=True)
class GpuSlotRequest:
    """What a run holds of a Prefect global concurrency limit from its first model load until it closes."""

    limit: str  # the limit's name
    occupy: int  # slots the run holds: its GPUs (at least 1)
    size: int  # the limit's size when the run creates it (an existing limit keeps its own)


def gpu_limit_name(cluster: str) -> str:
    """`omniflow-gpu-<cluster>` for `trainer.concurrency.gpu_limit: auto`: `cluster` is the host name for a cluster the
    run starts on its own machine, the GCS address for a cluster it joins, so runs on other machines never wait."""
    label = "".join("-" if c in _LIMIT_NAME_FORBIDDEN or c.isspace() else c for c in cluster)
    return f"omniflow-gpu-{label}"


def gpu_slot_request(config: Any, cluster: str, cluster_gpus: int, gpus: int | None = None) -> GpuSlotRequest | None:
    """The GPU slots a run of `config` holds (`trainer.concurrency`), or None: no limit (`gpu_limit: null`), or a run on
    no GPU under `auto`. `gpus`: the devices this work uses (default: the run's, `run_resource_budget`); `cluster`
    and `cluster_gpus`: the Ray cluster's label (see `gpu_limit_name`) and its GPU count, the size of a new limit
    unless `gpu_limit_size` is set. A named limit is shared by whoever names it, and a CPU run holds one slot of it."""
    cc = config.trainer.concurrency
    if cc.gpu_limit is None:
        return None
    gpus = run_resource_budget(config).gpus if gpus is None else gpus
    if cc.gpu_limit == AUTO_GPU_LIMIT and gpus == 0:
        return None
    name = gpu_limit_name(cluster) if cc.gpu_limit == AUTO_GPU_LIMIT else cc.gpu_limit
    occupy = max(1, gpus)
    size = cc.gpu_limit_size if cc.gpu_limit_size is not None else max(occupy, cluster_gpus)
    return GpuSlotRequest(limit=name, occupy=occupy, size=size)


def check_gpu_limit_size(request: GpuSlotRequest, size: int, what: str) -> None:
    """Refuse, naming the key, a limit of `size` slots that `request` could never get (it would wait forever)."""
    if size >= request.occupy:
        return
    from omni_core.config.errors import ConfigError, ConfigProblem

    raise ConfigError(
        [
            ConfigProblem(
                "trainer.concurrency.gpu_limit",
                f"{what} needs {request.occupy} slots (one per GPU) of global concurrency limit {request.limit!r}, "
                f"which has {size}: it would wait forever. Raise the limit (`prefect gcl update {request.limit} "
                f"--limit {request.occupy}`, or the UI's Concurrency page) or name another one",
                request.limit,
            )
        ]
    )


# ------------------------------------------------------------------------------------ placement plan
@dataclass(frozen=True)
class ActorSlot:
    """Where one actor runs: its bundle of the run's placement group and what it reserves there."""

    bundle: int
    num_cpus: float
    num_gpus: float  # a fraction when rollout and training share one device (sync mode, colocated)


@dataclass(frozen=True)
class ResourcePlan:
    """The run's Ray placement group (one bundle per training rank, PACK) and each actor's slot in it.

    In sync mode the rollout workers share the training devices as verl's colocated workers do: rollout
    worker ``j`` sits in bundle ``j % ranks``, and the processes of a bundle split its device equally.
    """

    device: str
    bundles: tuple[dict[str, float], ...]
    training: tuple[ActorSlot, ...]
    rollout: tuple[ActorSlot, ...]
    strategy: str = "PACK"

    @property
    def accelerator_resource(self) -> str | None:
        """Ray's resource name for the run's device (`GPU` for cuda, `NPU` for Ascend), None on cpu."""
        return ACCELERATOR_RESOURCES.get(self.device)


# Ray's resource name of each accelerator (Ray schedules NPUs as the custom resource "NPU").
ACCELERATOR_RESOURCES = {"cuda": "GPU", "npu": "NPU"}


def resource_plan(config: Any) -> ResourcePlan:
    """The placement of the training ranks and rollout workers of `config` (its `trainer.device` resolved).

    sync: rollout worker `j` shares bundle `j % ranks` with training rank `j % ranks` (colocated); with the hybrid
    engine it is rank `j` itself, so the plan has no rollout slots and each rank has its bundle's whole device.
    separate_async: bundles `0 .. ranks-1` hold the training ranks alone and each rollout worker has a bundle
    (and, on an accelerator, a whole device) of its own after them: the standalone rollout pool.
    """
    trainer = config.trainer
    ranks = trainer.n_gpus_per_node * trainer.nnodes
    workers = separate_rollout_worker_count(config)
    device = trainer.device
    accelerator = ACCELERATOR_RESOURCES.get(device)
    standalone = standalone_rollout(config)
    rollout_bundle = [ranks + j if standalone else j % ranks for j in range(workers)]
    per_bundle = [1 + sum(1 for b in rollout_bundle if b == r) for r in range(ranks)] + [1] * (workers if standalone else 0)

    def share(bundle: int) -> float:
        # Ray counts resources in units of 1e-4: round down so that a bundle's shares never exceed 1.
        return math.floor(10_000 / per_bundle[bundle]) / 10_000 if accelerator else 0.0

    training = tuple(ActorSlot(b, TRAINING_ACTOR_CPUS, share(b)) for b in range(ranks))
    rollout = tuple(ActorSlot(b, ROLLOUT_WORKER_CPUS, share(b)) for b in rollout_bundle)
    bundles = []
    for b in range(len(per_bundle)):
        cpus = sum(s.num_cpus for s in (*training, *rollout) if s.bundle == b)
        bundle: dict[str, float] = {"CPU": float(cpus)}
        if accelerator:
            bundle[accelerator] = 1.0
        bundles.append(bundle)
    return ResourcePlan(device=device, bundles=tuple(bundles), training=training, rollout=rollout)


def autoscaler_bundles(config: Any) -> list[dict[str, float]]:
    """What a run of `config` asks Ray's autoscaler for before it checks a joined cluster's capacity
    (`ray.autoscaler.sdk.request_resources(bundles=...)`): the bundles of its placement group (`resource_plan`), then
    one 1-CPU bundle for each other CPU of `run_resource_budget` (TransferQueue's controller and storage units, the
    fit_epoch task), so that the cluster the autoscaler grows holds the whole budget, bundle by bundle."""
    plan = resource_plan(config)
    budget = run_resource_budget(config)
    in_plan = sum(int(b.get("CPU", 0)) for b in plan.bundles)
    return [*(dict(b) for b in plan.bundles), *({"CPU": 1.0} for _ in range(budget.total_cpus - in_plan))]


def evaluation_resources(config: Any) -> dict[str, Any]:
    """Ray options of an evaluation task: one CPU and a whole device of `trainer.device` (none on cpu)."""
    options: dict[str, Any] = {"num_cpus": ROLLOUT_WORKER_CPUS}
    if config.trainer.device == "cuda":
        options["num_gpus"] = 1
    elif config.trainer.device in ACCELERATOR_RESOURCES:
        options["resources"] = {ACCELERATOR_RESOURCES[config.trainer.device]: 1}
    return options
