"""The run's Ray placement group and the options each actor is created with.

`resources.resource_plan` decides the bundles and slots (light, no Ray); this module makes them real:
`create_pool` reserves the placement group (named after the run, PACK, one bundle per training rank)
and waits for it with a bound (a bundle that no node can hold would otherwise wait forever, docs/design.md
section 7), `actor_options` gives the `.options(...)` of one actor in its bundle, and `remove_pool`
releases it when the run closes.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, get_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from omni_core.records import WorkerNames
from omni_core.resources import ActorSlot, ResourcePlan

# The ready wait on a local cluster (it cannot grow); a joined one waits `ray_kwargs.capacity_wait_s` (`pool_wait_s`).
POOL_READY_TIMEOUT_S = 120.0


def pool_name(names: WorkerNames) -> str:
    return f"omniflow-{names.run_id}-pool"


def pool_wait_s(config: Any) -> float:
    """How long `create_pool` waits for the placement group of a run of `config`: `ray_kwargs.capacity_wait_s` on a
    joined cluster (an autoscaler may be adding the nodes), `POOL_READY_TIMEOUT_S` on a local one."""
    return config.ray_kwargs.capacity_wait_s if config.ray_kwargs.ray_init.address else POOL_READY_TIMEOUT_S


def create_pool(plan: ResourcePlan, names: WorkerNames, timeout_s: float = POOL_READY_TIMEOUT_S) -> PlacementGroup:
    """Reserve the run's placement group (or reuse the one of this run that already exists)."""
    try:
        return get_placement_group(pool_name(names))
    except ValueError:
        pass
    group = placement_group(list(plan.bundles), strategy=plan.strategy, name=pool_name(names))
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise RuntimeError(
            f"Ray could not reserve the run's resources within {timeout_s:.0f}s: bundles {list(plan.bundles)} "
            f"(strategy {plan.strategy}); the cluster has {ray.available_resources()} available. Lower "
            "trainer.n_gpus_per_node / rollout.agent.num_workers, add resources, or (on a joined cluster that scales "
            "up) raise ray_kwargs.capacity_wait_s"
        ) from None
    return group


def actor_options(group: PlacementGroup, slot: ActorSlot, plan: ResourcePlan) -> dict[str, Any]:
    """`.options(...)` of an actor in `slot`: its CPUs and device share, inside its bundle."""
    options: dict[str, Any] = {
        "num_cpus": slot.num_cpus,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=slot.bundle, placement_group_capture_child_tasks=False
        ),
    }
    if plan.device == "cuda":
        options["num_gpus"] = slot.num_gpus
    elif plan.accelerator_resource:
        options["resources"] = {plan.accelerator_resource: slot.num_gpus}
    return options


def remove_pool(names: WorkerNames) -> None:
    """Release the run's placement group (after its actors were killed); nothing to do if it is gone."""
    try:
        remove_placement_group(get_placement_group(pool_name(names)))
    except ValueError:
        pass
