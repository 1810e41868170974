"""Devices and Ray resources: devices requested vs present, nodes, and the run's logical-CPU budget.

The budget is `omni_core.resources.run_resource_budget`, the same one the cluster check uses once Ray
is up (`omni_core.ray_cluster.check_cluster_devices`), so the two can never disagree.
"""

from __future__ import annotations

from omni_core.config import ConfigProblem, OmniFlowConfig
from omni_core.resources import run_resource_budget


def device_problems(config: OmniFlowConfig, device_counts: dict[str, int] | None = None) -> list[ConfigProblem]:
    """`device_counts` (`{"cuda": n, "npu": n, "cpu": cores}`) defaults to what this machine shows."""
    from omni_core.device import available_devices, detect_device

    p: list[ConfigProblem] = []
    trainer, ray_init = config.trainer, config.ray_kwargs.ray_init
    counts = device_counts or available_devices()
    device = detect_device(counts) if trainer.device == "auto" else trainer.device
    requested = trainer.n_gpus_per_node
    if trainer.nnodes == 1 and requested > counts.get(device, 0):
        what = "CPU cores (one training worker per core)" if device == "cpu" else f"{device} devices"
        p.append(
            ConfigProblem(
                "trainer.n_gpus_per_node",
                f"asks for {requested} but this machine has {counts.get(device, 0)} {what}; lower it",
                requested,
            )
        )
    if trainer.nnodes > 1 and not ray_init.address:
        p.append(
            ConfigProblem(
                "trainer.nnodes",
                "more than one node needs an existing Ray cluster; set ray_kwargs.ray_init.address",
                trainer.nnodes,
            )
        )
    # A reservation that cannot be met hangs forever (DESIGN.md section 7). A joined cluster is checked
    # once connected; a local one declares ray_init.num_cpus.
    budget = run_resource_budget(config)
    if ray_init.address is None and ray_init.num_cpus is not None and ray_init.num_cpus < budget.total_cpus:
        p.append(
            ConfigProblem(
                "ray_kwargs.ray_init.num_cpus",
                f"too few logical CPUs: the run reserves {budget.total_cpus} ({budget.describe_cpus()}); "
                f"use ray_kwargs.ray_init.num_cpus={max(16, budget.total_cpus)} (logical CPUs may exceed the cores)",
                ray_init.num_cpus,
            )
        )
    return p
