"""Connecting to Ray for a run: join `ray_kwargs.ray_init.address`, or start a local cluster with
enough logical CPUs, and check that the cluster has the devices the config asks for.

Ray leaves a task that asks for absent resources pending forever (DESIGN.md section 7), so the
device check runs before anything is submitted.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import ray

from omni_core.config import ConfigError, ConfigProblem, OmniFlowConfig

NAMESPACE = "omniflow"


def connect_ray(config: OmniFlowConfig, namespace: str = NAMESPACE) -> bool:
    """Initialise Ray for this process unless it already is; True when this call started a cluster."""
    if ray.is_initialized():
        return False
    init = config.ray_kwargs.ray_init
    os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")  # TransferQueue warns about its thread count on every call
    passed = ("PREFECT_API_URL", "PREFECT_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TQ_LOGGING_LEVEL")
    env = {"env_vars": {k: os.environ[k] for k in passed if k in os.environ}}
    # ray.init installs its own SIGTERM handler (it aborts the process, skipping every `finally`);
    # keep the caller's, so a stopped run still closes TransferQueue, its actors and its servers.
    previous = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    if init.address:
        # Ray 2.60 turns token auth on for local clusters; a client joining by address needs it too.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        ray.init(address=init.address, namespace=namespace, runtime_env=env, log_to_driver=True)
    else:
        ray.init(
            num_cpus=init.num_cpus,
            include_dashboard=init.include_dashboard,
            namespace=namespace,
            runtime_env=env,
            log_to_driver=True,
        )
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)
    return init.address is None


def dashboard_url() -> str | None:
    """`http://host:port` of the connected cluster's Ray dashboard, or None when it runs none."""
    try:
        from ray._private.worker import get_dashboard_url  # no public accessor after ray.init in Ray 2.60

        url = get_dashboard_url()
    except Exception:
        return None
    if not url:
        return None
    return url if url.startswith("http") else f"http://{url}"


def check_cluster_devices(config: OmniFlowConfig, resources: dict[str, Any] | None = None) -> None:
    """Fail with the key path when the cluster lacks the GPUs / CPUs the run reserves."""
    res = resources if resources is not None else ray.cluster_resources()
    t = config.trainer
    problems = []
    if t.device == "cuda":
        need = t.n_gpus_per_node * t.nnodes
        have = int(res.get("GPU", 0))
        if have < need:
            problems.append(
                ConfigProblem(
                    "trainer.n_gpus_per_node",
                    f"the run asks for {need} GPU(s) (x trainer.nnodes={t.nnodes}) but the Ray cluster has {have}; "
                    "Ray would leave the work pending forever. Lower it or use trainer.device=cpu",
                    t.n_gpus_per_node,
                )
            )
    workers = config.actor_rollout_ref.rollout.agent.num_workers
    units = config.transfer_queue.backend.SimpleStorage.num_data_storage_units
    need_cpus = 1 + units + 1 + workers + 1  # TQ controller + units, training actor, rollout workers, fit_epoch task
    if res.get("CPU", 0) < need_cpus:
        problems.append(
            ConfigProblem(
                "ray_kwargs.ray_init.num_cpus",
                f"the Ray cluster declares {res.get('CPU', 0):g} logical CPUs but the run reserves {need_cpus}; "
                f"start it with more (e.g. ray_kwargs.ray_init.num_cpus=16)",
                config.ray_kwargs.ray_init.num_cpus,
            )
        )
    if problems:
        raise ConfigError(problems)
