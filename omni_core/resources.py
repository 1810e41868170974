"""The Ray resources one run reserves, computed in one place.

`validate_config` compares this budget with what a local cluster will declare
(`ray_kwargs.ray_init.num_cpus`), and `check_cluster_resources` compares it with what the running
cluster has, before anything is submitted: Ray leaves a reservation that cannot be met pending
forever (DESIGN.md section 7). The actors and tasks that make up the budget take their reservations
from the constants here, so the budget cannot drift from what is asked for.

Light on purpose (no torch, no Ray): `omniflow validate` imports it.
"""

from __future__ import annotations

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


def run_resource_budget(config: Any) -> ResourceBudget:
    """What a run of `config` (an `OmniFlowConfig`) reserves on its Ray cluster."""
    units = config.transfer_queue.backend.SimpleStorage.num_data_storage_units
    workers = config.actor_rollout_ref.rollout.agent.num_workers
    trainer = config.trainer
    cpus = {
        "transfer_queue": TQ_CONTROLLER_CPUS + TQ_STORAGE_UNIT_CPUS * units,
        "training_actor": TRAINING_ACTOR_CPUS,
        "rollout_workers": ROLLOUT_WORKER_CPUS * workers,
        "fit_epoch_task": FIT_EPOCH_TASK_CPUS,
    }
    gpus = trainer.n_gpus_per_node * trainer.nnodes if trainer.device == "cuda" else 0
    return ResourceBudget(cpus=cpus, gpus=gpus)
