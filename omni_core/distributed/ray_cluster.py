"""A run's Ray side: join `ray_kwargs.ray_init.address` or start a local cluster with enough logical
CPUs and check the cluster against the run's resource budget (`connect_run_cluster`), start the TransferQueue
(`start_run_cluster`: both, verl-omni's `ray.init` + `tq.init`), and stop it all again (`close_run`, verl-omni's `finally: tq.close()`).

`ray_kwargs.ray_init` reaches `ray.init` as verl passes it (`ray_init_kwargs`): every key for a local
cluster, only `runtime_env` when joining one (validation refuses the cluster-shaping keys there); the
workers' `runtime_env.env_vars` merge the user's with the ones OmniFlow passes, the user's winning.

Ray leaves a task that asks for absent resources pending forever (docs/design.md section 7), so the
resource check runs before anything is submitted. A joined cluster may be an autoscaling one that holds less
than the run needs until it scales: the run first asks Ray's autoscaler for its bundles
(`request_run_resources`), then waits up to `ray_kwargs.capacity_wait_s` for them (`wait_for_capacity`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from omni_core.config import ConfigError, ConfigProblem, OmniFlowConfig
from omni_core.distributed.ray_auth import accepts_unauthenticated_requests, gcs_address_of, token_auth_warning
from omni_core.quiet import drop_library_notices
from omni_core.resources import autoscaler_bundles, run_resource_budget
from omni_core.tq.client import TQ_NUM_THREADS_DEFAULT

NAMESPACE = "omniflow"
# How often `wait_for_capacity` reads the cluster's resources again.
CAPACITY_POLL_S = 1.0

log = logging.getLogger("omniflow.ray_cluster")


# glibc malloc settings of the run's Ray workers: keep freed memory for the next allocation instead of returning
# it to the OS. A process that only samples (a rollout worker) frees its activations after every request; with
# glibc's defaults the top of its heap was trimmed each time and the next request faulted every page in again:
# ~150k minor faults per 16-image rollout of the main job, 1.6-2.1 s per rollout against 1.1-1.5 s with these
# (2 cores, alternating runs). The cost: a worker's resident memory stays at its peak. MMAP_THRESHOLD_ is
# glibc's 64-bit maximum, 32 MiB (setting TRIM_THRESHOLD_ alone would pin it at 128 KiB instead).
MALLOC_ENV = {"MALLOC_TRIM_THRESHOLD_": str(16 << 30), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}

# Environment variables of this process that every Ray worker of a run gets (a Prefect API instead of one
# temporary server per worker, offline hubs and the Hugging Face cache that a Hub id resolves in, TransferQueue's log
# level and thread count: omni_core.tq.client, the malloc settings above).
PASSED_ENV_VARS = (
    "PREFECT_API_URL",
    "PREFECT_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_HOME",
    "HF_HUB_CACHE",
    "TQ_LOGGING_LEVEL",
    "TQ_NUM_THREADS",
    *MALLOC_ENV,
)


# Ray starts idle Python workers ahead of any task (one per core) for the job's default environment; the run's tasks
# and actors start their own processes (another runtime_env), so those idle ones only cost start-up CPU and ~45 MB PSS
# each (measured on 2 cores: 2 idle workers in every run, never used).
NO_PRESTARTED_WORKERS = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}


def ray_job_runtime_env() -> dict[str, Any]:
    """The `runtime_env` of the Ray job whose driver this process is (`ray job submit`, `omniflow ray-job`, a KubeRay
    RayJob: Ray passes the job's config in an environment variable); empty outside a job."""
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    raw = os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR)
    return dict(json.loads(raw).get("runtime_env") or {}) if raw else {}


def worker_runtime_env(user_env: Mapping[str, Any] | None) -> dict[str, Any]:
    """The run's Ray `runtime_env`: `ray_kwargs.ray_init.runtime_env` with OmniFlow's env vars merged in.

    OmniFlow's `PASSED_ENV_VARS` (those set in this process) join the user's `env_vars`; on a clash the
    user's value wins, and the user's other runtime_env keys (pip, working_dir, ...) pass through as given.
    In a Ray job's driver, what the job's own runtime_env sets (a field, an env var) is left out: Ray already applies
    it to every worker of the job, and refuses a `ray.init` that sets it again (tried with Ray 2.60).
    """
    env = dict(user_env or {})
    ours = {k: os.environ[k] for k in PASSED_ENV_VARS if k in os.environ}
    env["env_vars"] = {**ours, **dict(env.get("env_vars") or {})}
    job = ray_job_runtime_env()
    env = {k: v for k, v in env.items() if k == "env_vars" or k not in job}
    env["env_vars"] = {k: v for k, v in env["env_vars"].items() if k not in (job.get("env_vars") or {})}
    return env


def ray_init_kwargs(config: OmniFlowConfig, namespace: str = NAMESPACE) -> dict[str, Any]:
    """The `ray.init` keywords of `ray_kwargs.ray_init`: all of them for a local cluster; with an address,
    only those Ray takes when joining (validation refuses the cluster-shaping ones there)."""
    init = config.ray_kwargs.ray_init
    kwargs: dict[str, Any] = {
        "namespace": namespace,
        "runtime_env": worker_runtime_env(init.runtime_env),
        "log_to_driver": True,
        "logging_level": logging.WARNING,
    }
    if init.address:
        return {"address": init.address, **kwargs}
    local = {
        "num_cpus": init.num_cpus,
        "num_gpus": init.num_gpus,
        "resources": dict(init.resources) if init.resources is not None else None,
        "object_store_memory": init.object_store_memory,
        "_temp_dir": init.temp_dir,
        "include_dashboard": init.include_dashboard,
        "_system_config": dict(NO_PRESTARTED_WORKERS),  # a copy: ray.init adds its spilling keys to the dict it gets
    }
    return {**{k: v for k, v in local.items() if v is not None}, **kwargs}


@contextlib.contextmanager
def loopback_node_ip() -> Iterator[None]:
    """Within: a local cluster started by `ray.init` gets node IP 127.0.0.1, so nothing of it listens beyond loopback.

    TransferQueue's controller and storage units bind their ZMQ sockets to `ray.util.get_node_ip_address()`
    and unpickle what arrives, with no authentication; Ray's own gRPC servers bind every interface unless the
    node IP is 127.0.0.1. `ray.init(_node_ip_address="127.0.0.1")` does not help: Ray rewrites a loopback
    address to the routable one (`services.resolve_ip_for_localhost`). Ray's local-only mode (what it uses on
    macOS and Windows, `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`) is read when Ray is imported, so it is switched
    on for the `ray.init` call only; the started node then keeps 127.0.0.1, and every worker learns it from
    its raylet. Joining a cluster by address never goes through here.
    """
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


class RayStartTimeoutError(TimeoutError):
    """The local Ray node this run started did not register with its GCS within the 30 s that Ray allows (fixed in
    Ray 2.60, `ray._private.node`), as happens on a host whose cores are all busy. A TimeoutError, so the `init_ray`
    task retries it (`omni_core.faults.is_retryable`); the processes of the failed start are stopped first."""


# Ray's words for a local node that did not register in time (ray._private.node.Node, a bare Exception).
_RAY_START_TIMEOUT_TEXT = "timed out during startup"


@contextlib.contextmanager
def _stopped_if_start_times_out() -> Iterator[None]:
    """Within: a local `ray.init`. If Ray gives up waiting for its node, the processes it had started (GCS server,
    raylet, dashboard, log monitor, reaper: children of this process that were not there before) are stopped, since
    Ray keeps no handle to them after the failed start, and `RayStartTimeoutError` is raised."""
    import psutil

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    try:
        yield
    except Exception as exc:
        if _RAY_START_TIMEOUT_TEXT not in str(exc):
            raise
        started = [p for p in me.children(recursive=True) if p.pid not in before]
        for proc in started:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(started, timeout=30)
        raise RayStartTimeoutError(
            f"the local Ray cluster did not start: {exc} (Ray waits 30 s for its node; the host may be busy). "
            f"Its {len(started)} processes are stopped; the start is retried."
        ) from exc


def connect_ray(config: OmniFlowConfig, namespace: str = NAMESPACE) -> bool:
    """Initialise Ray for this process unless it already is; True when this call started a cluster.

    A cluster started here listens on loopback only (`loopback_node_ip`); a joined one as its nodes do."""
    if ray.is_initialized():
        return False
    init = config.ray_kwargs.ray_init
    os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")  # TransferQueue warns about its thread count on every call
    os.environ.setdefault("TQ_NUM_THREADS", TQ_NUM_THREADS_DEFAULT)  # its storage units too (omni_core.tq.client)
    for name, value in MALLOC_ENV.items():  # read by glibc at process start: the workers', not this process's
        os.environ.setdefault(name, value)
    # ray.init installs its own SIGTERM handler (it aborts the process, skipping every `finally`);
    # keep the caller's, so a stopped run still closes TransferQueue, its actors and its servers.
    previous = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    # Ray's own INFO lines (e.g. "Started a local Ray instance") stay off. Its warnings show, except the
    # notice that it chose token auth (omni_core.quiet).
    drop_library_notices()
    if init.address:
        # Join in the cluster's own auth mode unless the user set one: token (Ray 2.60's default for clusters),
        # or disabled for a cluster that answers requests without a token (`ray_auth`; the run log warns).
        if "RAY_AUTH_MODE" not in os.environ:
            gcs = gcs_address_of(init.address)
            open_cluster = gcs is not None and accepts_unauthenticated_requests(gcs) is True
            os.environ["RAY_AUTH_MODE"] = "disabled" if open_cluster else "token"
            # Ray reads the mode once, at import: refresh it as Ray's own `_enable_token_auth` does (an env var
            # set alone leaves the client in the imported mode: InvalidAuthToken from a token cluster).
            from ray._raylet import Config

            Config.initialize("")
        ray.init(**ray_init_kwargs(config, namespace))
    else:
        global _session_dir
        with loopback_node_ip(), _stopped_if_start_times_out():
            context = ray.init(**ray_init_kwargs(config, namespace))
        _session_dir = context.address_info.get("session_dir")
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)
    return init.address is None


def ray_cluster_label(config: OmniFlowConfig) -> tuple[str, int]:
    """(label, GPUs) of the run's Ray cluster for its GPU slots (`resources.gpu_slot_request`): this host's name for a
    local cluster, the GCS address of a joined one; (host name, 0) when Ray is not connected."""
    if not ray.is_initialized():
        return socket.gethostname(), 0
    gpus = int(ray.cluster_resources().get("GPU", 0))
    joined = bool(config.ray_kwargs.ray_init.address)
    return (ray.get_runtime_context().gcs_address if joined else socket.gethostname()), gpus


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
    """Fail with the key path when the cluster lacks the GPUs / CPUs of the run's resource budget."""
    res = resources if resources is not None else ray.cluster_resources()
    t = config.trainer
    budget = run_resource_budget(config)
    problems = []
    have_gpus = int(res.get("GPU", 0))
    if have_gpus < budget.gpus:
        problems.append(
            ConfigProblem(
                "trainer.n_gpus_per_node",
                f"the run asks for {budget.gpus} GPU(s) (x trainer.nnodes={t.nnodes}) but the Ray cluster has {have_gpus}; "
                "Ray would leave the work pending forever. Lower it or use trainer.device=cpu",
                t.n_gpus_per_node,
            )
        )
    if res.get("CPU", 0) < budget.total_cpus:
        problems.append(
            ConfigProblem(
                "ray_kwargs.ray_init.num_cpus",
                f"the Ray cluster declares {res.get('CPU', 0):g} logical CPUs but the run reserves {budget.total_cpus} "
                f"({budget.describe_cpus()}); start it with more (e.g. ray_kwargs.ray_init.num_cpus=16)",
                config.ray_kwargs.ray_init.num_cpus,
            )
        )
    if problems:
        raise ConfigError(problems)


def request_run_resources(config: OmniFlowConfig) -> list[dict[str, float]]:
    """Ask the joined cluster's autoscaler for the run's bundles (`resources.autoscaler_bundles`); returns them.

    `request_resources` is one request per cluster (the last call wins) and persists until replaced, so the run
    withdraws it when it ends (`withdraw_resource_request`). A cluster without an autoscaler keeps the request
    unread."""
    from ray.autoscaler.sdk import request_resources

    global _requested_resources
    bundles = autoscaler_bundles(config)
    request_resources(bundles=bundles)
    _requested_resources = True
    return bundles


def withdraw_resource_request() -> None:
    """Replace this process's autoscaler request with an empty one, so the cluster may scale down again (the
    run's placement group and actors, while they live, keep their nodes anyway). Never fails a close."""
    global _requested_resources
    if not _requested_resources or not ray.is_initialized():
        return
    with contextlib.suppress(Exception):
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[])
    _requested_resources = False


def wait_for_capacity(config: OmniFlowConfig, wait_s: float, poll_s: float = CAPACITY_POLL_S) -> None:
    """`check_cluster_devices` until it passes or `wait_s` seconds have passed (an autoscaling cluster adds nodes
    meanwhile); then its error, with `ray_kwargs.capacity_wait_s` named as the bound that ran out."""
    deadline = time.monotonic() + wait_s
    logged = False
    while True:
        try:
            check_cluster_devices(config)
            return
        except ConfigError as exc:
            if time.monotonic() >= deadline:
                waited = ConfigProblem(
                    "ray_kwargs.capacity_wait_s",
                    f"the run waited {wait_s:g}s for the joined cluster (and its autoscaler, asked for the run's bundles) "
                    "to hold its resources; raise it for a cluster that scales up slower, or add nodes",
                    wait_s,
                )
                raise ConfigError([*exc.problems, waited]) from None
            if not logged:
                log.warning(f"waiting up to {wait_s:g}s (ray_kwargs.capacity_wait_s) for the Ray cluster to scale up: {exc}")
                logged = True
        time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))


# Whether this process has an autoscaler request in place (`request_run_resources`), withdrawn when the run closes.
_requested_resources = False
# Whether `start_run_cluster` in this process started the Ray cluster that is still up: a retried
# init_transfer_queue finds Ray initialised by its own earlier try, and must still report (and close) it as
# this run's.
_started_ray = False
# The session folder (logs, sockets) of the local cluster this process started last; its logs are kept with the run.
_session_dir: str | None = None
# Ray's own logs kept with a run (`keep_ray_logs`): the last this many bytes of each file.
RAY_LOG_TAIL_BYTES = 8 << 20


@dataclass(frozen=True)
class RunCluster:
    """What `start_run_cluster` set up: whether this process started the Ray cluster (and so must stop
    it), and the address of its dashboard (None when none runs)."""

    owns_ray: bool
    dashboard_url: str | None
    # For a joined cluster (ray_kwargs.ray_init.address) that answers requests carrying no token (`ray_auth`):
    # the line the run log shows.
    auth_warning: str | None = None


def connect_run_cluster(config: OmniFlowConfig) -> RunCluster:
    """Connect Ray, check that every node sees the run's folders (`shared_storage`, multi-node clusters only)
    and that the cluster holds the run's resource budget (the TransferQueue's reservations included). A joined
    cluster is first asked to scale to the run's bundles and then given `ray_kwargs.capacity_wait_s` to hold them.

    A failure after this call started a local cluster stops that cluster again, so a retry starts clean.
    """
    global _started_ray
    from omni_core.distributed.shared_storage import check_shared_storage

    _started_ray = connect_ray(config) or (_started_ray and ray.is_initialized())
    joined = config.ray_kwargs.ray_init.address is not None
    try:
        if joined:
            request_run_resources(config)  # the autoscaler works while the storage check runs
        check_shared_storage(config)
        if joined:
            wait_for_capacity(config, config.ray_kwargs.capacity_wait_s)
        else:
            check_cluster_devices(config)
    except BaseException:
        withdraw_resource_request()
        if _started_ray:
            ray.shutdown()
            _started_ray = False
        raise
    auth_warning = None
    if config.ray_kwargs.ray_init.address is not None:
        gcs = ray.get_runtime_context().gcs_address
        auth_warning = token_auth_warning(gcs) if accepts_unauthenticated_requests(gcs) else None
    return RunCluster(_started_ray, dashboard_url(), auth_warning)


def start_run_cluster(config: OmniFlowConfig) -> RunCluster:
    """`connect_run_cluster`, then the TransferQueue (verl-omni's `tq.init`); a failed TransferQueue start stops
    a cluster this call started. The flow runs the two as separate stages, so that the TransferQueue's processes
    start while the data and the actors load."""
    global _started_ray
    from omni_core.tq.client import init_transfer_queue

    cluster = connect_run_cluster(config)
    try:
        init_transfer_queue(config.transfer_queue)
    except BaseException:
        if _started_ray:
            ray.shutdown()
            _started_ray = False
        raise
    return cluster


def close_run(trainer: Any, owns_ray: bool) -> None:
    """The end of every run, also a failed one: the trainer's actors and TQ rows (`trainer.close()`,
    when a trainer was built), the TransferQueue, and the Ray cluster when this run started it."""
    global _started_ray
    from omni_core.tq.client import close_transfer_queue

    if trainer is not None and ray.is_initialized():
        trainer.close()
    close_transfer_queue()
    withdraw_resource_request()
    # `_started_ray` also covers a run whose init_transfer_queue task failed after starting Ray (owns_ray unknown).
    if owns_ray or _started_ray:
        ray.shutdown()
        _started_ray = False
        if trainer is not None and _session_dir is not None:
            keep_ray_logs(_session_dir, Path(trainer.run.log_dir) / "ray")


def keep_ray_logs(session_dir: str | Path, dest: Path, tail_bytes: int = RAY_LOG_TAIL_BYTES) -> None:
    """Copy the `logs` of a Ray session this run started (GCS, raylet, the driver's and every worker's core-worker
    log and output) to `dest`, the last `tail_bytes` of each file: what Ray itself logged stays with the run's
    metrics after Ray's temporary session folder is gone. Never fails the run's close."""
    src = Path(session_dir) / "logs"
    for file in sorted(src.rglob("*")) if src.is_dir() else []:
        with contextlib.suppress(OSError):
            if not file.is_file():
                continue
            target = dest / file.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            with file.open("rb") as f_in, target.open("wb") as f_out:
                f_in.seek(max(0, file.stat().st_size - tail_bytes))
                shutil.copyfileobj(f_in, f_out)
