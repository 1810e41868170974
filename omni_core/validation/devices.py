"""Devices and Ray resources: devices requested vs present, the `ray.init` arguments, and the run's budget.

The budget is `omni_core.resources.run_resource_budget`, the same one the cluster check uses once Ray
is up (`omni_core.distributed.ray_cluster.check_cluster_devices`), so the two can never disagree.
"""

from __future__ import annotations

from collections.abc import Mapping

from omni_core.config import ConfigProblem, OmniFlowConfig
from omni_core.resources import run_resource_budget

# ray_init keys that shape a cluster: `ray.init` refuses them (or cannot apply them) when joining one by address.
CLUSTER_SHAPING_KEYS = ("num_gpus", "resources", "object_store_memory", "_temp_dir")


def device_problems(config: OmniFlowConfig, device_counts: dict[str, int] | None = None) -> list[ConfigProblem]:
    """`device_counts` (`{"cuda": n, "npu": n, "cpu": cores}`) defaults to what this machine shows."""
    from omni_core.device import available_devices, detect_device

    p: list[ConfigProblem] = []
    trainer, ray_init = config.trainer, config.ray_kwargs.ray_init
    counts = device_counts or available_devices()
    device = detect_device(counts) if trainer.device == "auto" else trainer.device
    requested = trainer.n_gpus_per_node
    # A joined cluster's devices are checked once connected (check_cluster_devices), not the driver's.
    if trainer.nnodes == 1 and ray_init.address is None and requested > counts.get(device, 0):
        what = "CPU cores (one training worker per core)" if device == "cpu" else f"{device} devices"
        p.append(
            ConfigProblem(
                "trainer.n_gpus_per_node",
                f"asks for {requested} but this machine has {counts.get(device, 0)} {what}; lower it",
                requested,
            )
        )
    ranks = trainer.n_gpus_per_node * trainer.nnodes
    strategy = config.actor_rollout_ref.actor.strategy
    if ranks > 1 and strategy == "torch":
        p.append(
            ConfigProblem(
                "actor_rollout_ref.actor.strategy",
                f"torch trains on one rank, but trainer.n_gpus_per_node x trainer.nnodes = {trainer.n_gpus_per_node} x "
                f"{trainer.nnodes} asks for {ranks}; use actor_rollout_ref.actor.strategy=ddp (data-parallel ranks) or "
                "one rank",
                strategy,
            )
        )
    if device == "npu":  # Inductor has not been tried on Ascend: refused rather than left to fail inside a worker
        for role in ("actor", "rollout"):
            if getattr(config.actor_rollout_ref, role).use_torch_compile:
                p.append(
                    ConfigProblem(
                        f"actor_rollout_ref.{role}.use_torch_compile",
                        "torch.compile (Inductor) is not supported on trainer.device=npu in OmniFlow; set it to false",
                        True,
                    )
                )
    p.extend(fsdp2_problems(config))
    if ray_init.address is None:  # a joined cluster's torch is the workers', not this driver's
        p.extend(distributed_problems(config, device))
    # A reservation that cannot be met hangs forever (docs/design.md section 7). A joined cluster is checked
    # once connected; a local one declares ray_init.num_cpus (and num_gpus, when set).
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
    if ray_init.address is None and ray_init.num_gpus is not None and ray_init.num_gpus < budget.gpus:
        p.append(
            ConfigProblem(
                "ray_kwargs.ray_init.num_gpus",
                f"the local cluster would declare {ray_init.num_gpus} GPU(s) but the run needs {budget.gpus} "
                f"(trainer.n_gpus_per_node x trainer.nnodes on trainer.device=cuda); Ray would leave the work pending "
                f"forever. Use ray_kwargs.ray_init.num_gpus={budget.gpus} or leave it null",
                ray_init.num_gpus,
            )
        )
    p.extend(ray_init_problems(config))
    return p


def distributed_problems(config: OmniFlowConfig, device: str) -> list[ConfigProblem]:
    """Whether the installed torch can run `actor.strategy` on `device`: torch.distributed with the device's
    backend (gloo, NCCL; HCCL comes with torch_npu and is not checked here) and, for fsdp2, `fully_shard`."""
    strategy = config.actor_rollout_ref.actor.strategy
    if strategy == "torch":
        return []
    import torch
    import torch.distributed as dist

    from omni_core.device import PROCESS_GROUP_BACKENDS

    key, build = "actor_rollout_ref.actor.strategy", f"the installed torch {torch.__version__}"
    if not dist.is_available():
        reason = f"{build} was built without torch.distributed, which strategy={strategy} needs on trainer.device={device}"
        return [
            ConfigProblem(
                key,
                f"{reason}; install a torch build with distributed support, or train on one rank with strategy=torch",
                strategy,
            )
        ]
    backend = PROCESS_GROUP_BACKENDS.get(device)
    available = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available}.get(backend or "")
    if available is not None and not available():
        return [
            ConfigProblem(
                key,
                f"{build} has no {backend} backend, which strategy={strategy} uses on trainer.device={device}; install a "
                f"torch build for {device} with {backend}, or train on one rank with strategy=torch",
                strategy,
            )
        ]
    if strategy == "fsdp2":
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: F401
        except ImportError as exc:
            return [
                ConfigProblem(
                    key,
                    f"{build} cannot run FSDP2 on trainer.device={device} ({exc}); install torch >= 2.6, or use strategy=ddp",
                    strategy,
                )
            ]
    return []


def fsdp2_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    """What `actor.strategy=fsdp2` does not combine with (each with the way out)."""
    actor = config.actor_rollout_ref.actor
    if actor.strategy != "fsdp2":
        return []
    p: list[ConfigProblem] = []
    fsdp = actor.fsdp_config
    if fsdp.compute_dtype == "float16":
        p.append(
            ConfigProblem(
                "actor_rollout_ref.actor.fsdp_config.dtype",
                "fsdp2 computes in its MixedPrecisionPolicy without a gradient scaler, which float16 needs; use "
                "bfloat16 (or strategy=ddp for float16 with a scaler)",
                fsdp.compute_dtype,
            )
        )
    if "optimizer" not in actor.checkpoint.save_contents:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.actor.checkpoint.save_contents",
                "fsdp2 checkpoints always hold the sharded optimizer state (they are how the ranks resume); "
                "add optimizer, or use strategy=ddp for export-only checkpoints",
                list(actor.checkpoint.save_contents),
            )
        )
    if actor.ema.enable:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.actor.ema.enable",
                "the moving average of FSDP2 shards is not implemented (each rank would average its own shards and "
                "validation would need them gathered); use strategy=ddp or torch with the EMA, or turn it off",
                True,
            )
        )
    return p


def ray_init_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    """`ray.init` arguments that do not go together: cluster-shaping keys with an address, a malformed runtime_env."""
    p: list[ConfigProblem] = []
    ray_init = config.ray_kwargs.ray_init
    if ray_init.address is not None:
        dumped = ray_init.model_dump()
        for key in CLUSTER_SHAPING_KEYS:
            if dumped[key] is not None:
                p.append(
                    ConfigProblem(
                        f"ray_kwargs.ray_init.{key}",
                        f"shapes a local cluster, but ray_kwargs.ray_init.address={ray_init.address} joins an existing "
                        "one (Ray refuses it there); set it when starting that cluster (ray start), or drop the address",
                        dumped[key],
                    )
                )
        if ray_init.include_dashboard:
            p.append(
                ConfigProblem(
                    "ray_kwargs.ray_init.include_dashboard",
                    f"starts a local cluster's dashboard, but ray_kwargs.ray_init.address={ray_init.address} joins an "
                    "existing cluster (its dashboard is started with it); set it to false",
                    True,
                )
            )
    env = ray_init.runtime_env
    if env is not None:
        env_vars = env.get("env_vars")
        if env_vars is not None and (
            not isinstance(env_vars, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items())
        ):
            p.append(
                ConfigProblem(
                    "ray_kwargs.ray_init.runtime_env.env_vars",
                    "must map names to strings (Ray's runtime_env contract); quote numbers, e.g. {NCCL_DEBUG: '1'}",
                    env_vars,
                )
            )
    return p
