"""The TransferQueue adapter: start / attach / close, per-run partitions, prompt and trajectory rows.

A thin layer over the real ``transfer_queue`` package (PyPI ``transferqueue``), the v1 data plane between
rollout and training. It owns three things TQ leaves to its callers:

* start-up that fails instead of hanging: TQ's controller and each SimpleStorage unit reserve one
  logical Ray CPU for their lifetime, and ``tq.init`` waits forever when they do not fit (docs/design.md section 7);
* the row schema (below), with per-run partition ids, since one named controller serves every run on a
  Ray cluster (docs/design.md section 2);
* deterministic reads: rows come back sorted by key, as dense tensors where TQ hands back jagged ones.

Row schema (one TQ partition per run and split, ``f"{run_id}/train"``):

* prompt row, key ``uid``, no fields, tag
  ``{"is_prompt": True, "status": "pending"|"running"|"finished"|"failure", "global_steps": int,
  "reason": str}`` (``reason`` only after a failure);
* trajectory row, key ``f"{uid}_{session}_{index}"``, fields = one sample of a rollout batch, tag
  ``{"is_prompt": False, "status": "success"|"failure", "global_steps": int, "model_version": int,
  "uid": str, ...}``.

Tags travel through the controller and ``kv_list`` returns all of them on every replay-buffer poll, so
they hold small scalars only. Strings that belong to a sample (prompt text, data_source) are fields:
TQ stores non-tensor columns as ``tensordict.NonTensorStack`` (one msgpack value per sample) and
``get_trajectories`` returns them as ``list[str]``.

``ray``, ``transfer_queue`` and ``tensordict`` are imported inside the functions: importing them costs
~4 s on 2 cores, which processes that only build names (the flow, validate_config) should not pay.

TransferQueue's client sets torch's thread count to ``TQ_NUM_THREADS`` (default 8, capped at the physical
cores) around every put and get, in its own event-loop thread. Torch ops there then start a second OpenMP
thread pool in the process, and libgomp, seeing more pool threads than CPUs, stops spinning between parallel
regions in every pool: the training actor's and rollout worker's own kernels then wait on futex wake-ups
(measured on 2 cores: ~1000 voluntary context switches/s instead of ~60, each compute phase 1.3-1.5x slower).
``TQ_NUM_THREADS_DEFAULT`` (1) keeps TQ's copies single-threaded; a value set in the environment wins.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from omni_core.records import partition_id  # noqa: F401  (a run's partition names, re-exported with the client)
from omni_core.resources import TQ_CONTROLLER_CPUS, TQ_STORAGE_UNIT_CPUS, auto_storage_units

logger = logging.getLogger(__name__)

# Read by transfer_queue at import, which happens in this module's functions (see the module docstring).
TQ_NUM_THREADS_DEFAULT = "1"
os.environ.setdefault("TQ_NUM_THREADS", TQ_NUM_THREADS_DEFAULT)

# Prompt-row statuses (pending -> running -> finished | failure), as in verl's v1 agent loop.
PENDING, RUNNING, FINISHED, FAILURE = "pending", "running", "finished", "failure"
PROMPT_STATUSES = (PENDING, RUNNING, FINISHED, FAILURE)
# Trajectory-row statuses.
SUCCESS = "success"
TRAJECTORY_STATUSES = (SUCCESS, FAILURE)
# Tag keys a trajectory row must carry (``uid`` is filled in from the key when missing).
REQUIRED_TRAJECTORY_TAGS = ("status", "global_steps", "model_version")

# TQ's own names (transfer_queue/interface.py): the controller is one named actor per cluster.
_CONTROLLER_NAME, _CONTROLLER_NAMESPACE = "TransferQueueController", "transfer_queue"
# SimpleStorage units are named f"TransferQueueStorageUnit#{rank}", in the namespace of the process that started TQ.
_STORAGE_UNIT_PREFIX = "TransferQueueStorageUnit#"

# Whether this process started the controller (and so owns the storage actors); see close_transfer_queue.
_owns_controller = False

# A TQ call that has not answered after this long makes the caller check that TQ's actors still live (TQ's
# own requests to a dead controller wait forever, to a dead storage unit ~10 minutes); then every few seconds.
LIVENESS_CHECK_AFTER_S = 2.0
# Bounds of a restart: the old actors' names and CPUs must be free before the new ones are created.
RESTART_TIMEOUT_S = 120.0

_T = TypeVar("_T")


class TransferQueueCapacityError(RuntimeError):
    """The Ray cluster cannot host TransferQueue's controller and storage units (tq.init would hang)."""


class TransferQueueUnavailableError(RuntimeError):
    """The TransferQueue controller or a storage unit of the cluster is gone (its process died): its requests
    would wait forever. The run's rows went with it; `restart_transfer_queue` starts a new one."""


# ------------------------------------------------------------------------------------ names and keys
def trajectory_key(uid: str, session: int | str, index: int = 0) -> str:
    """Key of one trajectory row, ``f"{uid}_{session}_{index}"`` (verl-omni's layout; index is 0 for
    single-turn diffusion). ``session`` and ``index`` may not contain '_' so that the uid parses back."""
    if "_" in str(session) or "_" in str(index):
        raise ValueError(f"session={session!r} and index={index!r} may not contain '_'")
    return f"{uid}_{session}_{index}"


def uid_of_key(key: str) -> str:
    """The prompt uid of a trajectory key (the uid itself may contain '_')."""
    parts = key.rsplit("_", 2)
    if len(parts) != 3:
        raise ValueError(f"{key!r} is not a trajectory key '<uid>_<session>_<index>'")
    return parts[0]


# -------------------------------------------------------------------------------- start-up and close
def check_ray_capacity(
    available: Mapping[str, float], num_storage_units: int, cluster: Mapping[str, float] | None = None
) -> None:
    """Raise TransferQueueCapacityError unless ``available`` logical CPUs fit the controller plus
    ``num_storage_units`` storage units. ``available`` / ``cluster`` are ``ray.available_resources()`` /
    ``ray.cluster_resources()`` (plain dicts, so the rule is testable without a cluster)."""
    needed = TQ_CONTROLLER_CPUS + TQ_STORAGE_UNIT_CPUS * num_storage_units
    free = float(available.get("CPU", 0.0))
    if free >= needed:
        return
    total = float((cluster or {}).get("CPU", free))
    if total >= needed:
        hint = (
            f"The cluster declares {total:g} but other actors hold the rest: start TransferQueue before the "
            f"worker groups, or raise ray_kwargs.ray_init.num_cpus."
        )
    else:
        hint = (
            f"Raise ray_kwargs.ray_init.num_cpus to at least {needed} (logical CPUs may exceed the cores; 16 is "
            f"the OmniFlow default; for a cluster joined by ray_kwargs.ray_init.address, start its nodes with "
            f"more --num-cpus) or lower transfer_queue.backend.SimpleStorage.num_data_storage_units."
        )
    raise TransferQueueCapacityError(
        f"TransferQueue needs {needed} logical Ray CPUs (controller {TQ_CONTROLLER_CPUS} + "
        f"transfer_queue.backend.SimpleStorage.num_data_storage_units={num_storage_units}, one each) but the "
        f"Ray cluster has {free:g} available; tq.init would wait forever. {hint}"
    )


def _controller_exists() -> bool:
    import ray

    try:
        ray.get_actor(_CONTROLLER_NAME, namespace=_CONTROLLER_NAMESPACE)
    except ValueError:
        return False
    return True


def _to_tq_conf(tq_cfg: Any):
    """The config section (pydantic model, mapping or DictConfig) as the DictConfig ``tq.init`` merges."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(tq_cfg, DictConfig):
        data = OmegaConf.to_container(tq_cfg, resolve=True)
    elif hasattr(tq_cfg, "model_dump"):
        data = tq_cfg.model_dump()
    else:
        data = dict(tq_cfg)
    # `enable` is verl's switch (the v1 runner forces it on); TQ has no such key.
    data.pop("enable", None)
    simple = (data.get("backend") or {}).get("SimpleStorage")
    if isinstance(simple, dict) and simple.get("num_data_storage_units", 0) is None:
        simple["num_data_storage_units"] = auto_storage_units()  # null: sized from this machine
    return OmegaConf.create(data)


def init_transfer_queue(tq_cfg: Any) -> bool:
    """Start TransferQueue from the ``transfer_queue`` config section, or attach to the cluster's running
    controller (several runs may share one). Returns True when this call started it.

    Ray must be initialised (``ray_kwargs.ray_init``) first. Before starting, the free logical CPUs are
    checked against what TQ reserves, so a too-small cluster fails here with the fix instead of hanging.
    """
    global _owns_controller
    import ray

    if not ray.is_initialized():
        raise RuntimeError(
            "Ray is not initialised: call ray.init(**ray_kwargs.ray_init) (num_cpus >= 1 + "
            "transfer_queue.backend.SimpleStorage.num_data_storage_units) before init_transfer_queue."
        )
    import transfer_queue as tq

    if _controller_exists():
        # Another run on this cluster started it; TQ ignores a conf when joining, so say so.
        logger.info("TransferQueue is already running on this Ray cluster: joining it (its storage settings apply).")
        tq.init()
        return False
    conf = _to_tq_conf(tq_cfg)
    backend = conf.backend.storage_backend
    if backend == "SimpleStorage":
        check_ray_capacity(
            ray.available_resources(), int(conf.backend.SimpleStorage.num_data_storage_units), ray.cluster_resources()
        )
    _owns_controller = True  # also when tq.init fails part-way: close_transfer_queue then stops what it started
    tq.init(conf)
    return True


def attach() -> None:
    """Join the running TransferQueue from another process (a Ray task or actor): a bare ``tq.init()``.
    Pair it with ``detach()``, never ``tq.close()``, which would kill the shared controller.

    Idempotent; a process whose client still talks to a TransferQueue that was since restarted
    (``restart_transfer_queue``) drops that client and joins the new one.
    """
    import ray
    import transfer_queue as tq
    from transfer_queue import interface

    try:
        live = ray.get_actor(_CONTROLLER_NAME, namespace=_CONTROLLER_NAMESPACE)
    except ValueError:  # never started (the driver calls init_transfer_queue first), or its process died
        raise TransferQueueUnavailableError(
            "No TransferQueueController on this Ray cluster: it died, or the driver did not call init_transfer_queue "
            "first (or this process is connected to another cluster)."
        ) from None
    known = interface._TQ_CONTROLLER
    if known is not None and known._actor_id != live._actor_id:  # TQ was restarted since this process joined
        detach()
        interface._TQ_CONTROLLER = None
    try:
        tq.init()  # asks the controller for its config
    except ray.exceptions.RayActorError as exc:  # the name still resolves for a while after the process died
        raise TransferQueueUnavailableError(f"the TransferQueueController died: {exc}") from exc


def detach() -> None:
    """Close this process's TQ client, leaving the controller running.

    Why not ``tq.close()``: after a bare ``tq.init()`` TQ keeps the controller handle it looked up, and
    ``tq.close()`` kills it, i.e. a worker that finishes would take the whole queue down with it. The
    controller handle itself is kept: in the process that created the controller, dropping the last
    handle lets Ray garbage-collect the (named, non-detached) actor, which is the same as killing it.
    """
    from transfer_queue import interface

    client, interface._TQ_CLIENT = interface._TQ_CLIENT, None
    if client is not None:
        client.close()


def close_transfer_queue() -> None:
    """Shut TransferQueue down if this process started it (controller, storage units, client); otherwise
    only detach. Safe to call twice and in a ``finally``."""
    global _owns_controller
    import transfer_queue as tq

    if _owns_controller:
        tq.close()
        _owns_controller = False
    else:
        detach()


def restart_transfer_queue(tq_cfg: Any) -> list[str]:
    """Replace a TransferQueue whose controller or a storage unit died, with the ``transfer_queue`` settings of
    ``tq_cfg``; returns the dead actors it found ([] when it was healthy, e.g. another run restarted it first).

    What is left of the old one (live storage units, a live controller) is killed, since its rows are
    incomplete; the new one starts once the old names and CPUs are free. Rows are lost: the caller redoes the
    epoch from its last checkpoint, and every process joins the new one with ``attach``. The process that
    started the old TransferQueue owns (and closes) the new one; a run that had joined another's leaves
    it running at its end, as before.
    """
    global _owns_controller
    import ray
    from transfer_queue import interface

    dead = dead_transfer_queue_actors()
    if not dead:
        attach()
        return []
    owned = _owns_controller
    for name, namespace in _transfer_queue_actor_names():
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        except ValueError:  # gone already
            pass
    detach()
    interface._TQ_CONTROLLER, interface._TQ_STORAGE = None, None
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while _transfer_queue_actor_names():
        if time.monotonic() > deadline:
            raise TransferQueueUnavailableError(
                f"the dead TransferQueue's actors {_transfer_queue_actor_names()} were still registered with Ray "
                f"after {RESTART_TIMEOUT_S:g} s; no new TransferQueue was started"
            )
        time.sleep(0.2)
    while True:  # the killed actors' CPUs come back asynchronously
        try:
            init_transfer_queue(tq_cfg)
            break
        except TransferQueueCapacityError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    _owns_controller = owned
    return dead


def _transfer_queue_actor_names() -> list[tuple[str, str]]:
    """(name, namespace) of every live actor of TransferQueue's: its controller and storage units."""
    import ray

    return [
        (a["name"], a["namespace"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"] == _CONTROLLER_NAME or a["name"].startswith(_STORAGE_UNIT_PREFIX)
    ]


def dead_transfer_queue_actors(timeout_s: float = 10.0) -> list[str]:
    """The TransferQueue actors that are gone or do not answer Ray within ``timeout_s``: the controller, or
    the storage units its config lists (SimpleStorage). [] when every one is alive."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    live = dict(_transfer_queue_actor_names())
    if _CONTROLLER_NAME not in live:
        return [_CONTROLLER_NAME]
    try:
        controller = ray.get_actor(_CONTROLLER_NAME, namespace=_CONTROLLER_NAMESPACE)
        conf = ray.get(controller.get_config.remote(), timeout=timeout_s)
    except (ValueError, RayActorError, GetTimeoutError):
        return [_CONTROLLER_NAME]
    units = list(conf.backend.SimpleStorage.get("zmq_info") or {}) if conf.backend.storage_backend == "SimpleStorage" else []
    dead = [u for u in units if u not in live]
    handles = {u: ray.get_actor(u, namespace=live[u]) for u in units if u in live}
    for unit, handle in handles.items():
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=timeout_s)
        except (RayActorError, GetTimeoutError):
            dead.append(unit)
    return sorted(dead)


def _guarded(what: str, call: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``call(*args, **kwargs)`` (one TQ request), failing with TransferQueueUnavailableError instead of waiting
    forever when a TransferQueue actor died: a call that fails, or that is still waiting after
    ``LIVENESS_CHECK_AFTER_S`` (and every few seconds after), checks the actors. The request runs on a daemon
    thread, so one stuck on a dead peer never holds this process (or its exit)."""
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            outcome["value"] = call(*args, **kwargs)
        except BaseException as exc:  # handed to the caller below
            outcome["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name=f"omniflow-tq-{what}", daemon=True).start()
    while not done.wait(LIVENESS_CHECK_AFTER_S):
        dead = dead_transfer_queue_actors()
        if dead:
            raise TransferQueueUnavailableError(
                f"TransferQueue {what}: {', '.join(dead)} died (its process is gone); the request would wait forever"
            )
    if "error" in outcome:
        error = outcome["error"]
        if isinstance(error, Exception):
            dead = dead_transfer_queue_actors()
            if dead:
                raise TransferQueueUnavailableError(f"TransferQueue {what}: {', '.join(dead)} died: {error}") from error
        raise error
    return outcome["value"]


# --------------------------------------------------------------------------------------- prompt rows
def put_prompts(partition: str, uids: Sequence[str], global_step: int, model_version: int | None = None) -> None:
    """Register prompt rows (tag only) as ``pending`` for ``global_step``; ``model_version``: the weight version
    their rollout will use (separate_async, where a request carries its weights), so that the staleness of a
    group still in flight is known."""
    import transfer_queue as tq

    uids = list(uids)
    if not uids:
        return
    tag: dict[str, Any] = {"is_prompt": True, "status": PENDING, "global_steps": int(global_step)}
    if model_version is not None:
        tag["model_version"] = int(model_version)
    tags = [dict(tag) for _ in uids]
    _guarded("put_prompts", tq.kv_batch_put, keys=uids, partition_id=partition, tags=tags)


def set_prompt_status(partition: str, uids: Sequence[str], status: str, reason: str | None = None) -> None:
    """Move prompt rows to ``status`` (pending -> running -> finished | failure). TQ merges the new tag into
    the stored one, so ``global_steps`` stays. ``reason`` is recorded with a failure."""
    import transfer_queue as tq

    if status not in PROMPT_STATUSES:
        raise ValueError(f"status={status!r} must be one of {PROMPT_STATUSES}")
    uids = list(uids)
    if not uids:
        return
    tag: dict[str, Any] = {"status": status}
    if status == FAILURE:
        tag["reason"] = reason or "unknown"
    _guarded("set_prompt_status", tq.kv_batch_put, keys=uids, partition_id=partition, tags=[dict(tag) for _ in uids])


# ----------------------------------------------------------------------------------- trajectory rows
def _as_column(name: str, value: Any, batch: int) -> Any:
    from tensordict import NonTensorStack

    if isinstance(value, torch.Tensor):
        if value.shape[:1] != (batch,):
            raise ValueError(f"field {name!r} has shape {tuple(value.shape)}; batch dim must be {batch}")
        return value.detach().cpu()
    values = list(value)
    if len(values) != batch:
        raise ValueError(f"field {name!r} has {len(values)} values; expected {batch}")
    return NonTensorStack(*values)


def put_trajectories(
    partition: str,
    keys: Sequence[str],
    fields: Mapping[str, torch.Tensor | Sequence[Any]],
    tags: Sequence[Mapping[str, Any]],
) -> None:
    """Write trajectory rows: ``fields`` holds batched tensors (batch dim first) or per-sample lists (strings
    are stored as non-tensor columns); ``tags[i]`` carries status, global_steps and model_version of row i."""
    import transfer_queue as tq
    from tensordict import TensorDict

    keys = list(keys)
    duplicates = sorted(k for k, n in Counter(keys).items() if n > 1)
    if duplicates:
        raise ValueError(f"duplicate trajectory keys: {duplicates}")
    if len(tags) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(tags)} tags")
    full_tags = []
    for key, tag in zip(keys, tags, strict=True):
        missing = [k for k in REQUIRED_TRAJECTORY_TAGS if k not in tag]
        if missing:
            raise ValueError(f"tag of {key!r} lacks {missing}; a trajectory tag needs {REQUIRED_TRAJECTORY_TAGS}")
        if tag["status"] not in TRAJECTORY_STATUSES:
            raise ValueError(f"tag of {key!r}: status={tag['status']!r} must be one of {TRAJECTORY_STATUSES}")
        uid = uid_of_key(key)
        if tag.get("uid", uid) != uid:
            raise ValueError(f"tag uid={tag['uid']!r} does not match key {key!r}")
        full_tags.append({"is_prompt": False, "uid": uid, **tag})
    batch = len(keys)
    columns = {name: _as_column(name, value, batch) for name, value in fields.items()}
    data = TensorDict(columns, batch_size=[batch])
    _guarded("put_trajectories", tq.kv_batch_put, keys=keys, partition_id=partition, fields=data, tags=full_tags)


def _densify(value: Any) -> Any:
    """TQ packs every non-scalar column as a nested tensor (jagged, or strided when more than one dim is
    ragged) and strings as a NonTensorStack: dense tensor when all rows agree in shape, else the nested
    tensor as TQ gave it; list for non-tensor columns."""
    from tensordict import NonTensorStack

    if isinstance(value, NonTensorStack):
        return value.tolist()
    if isinstance(value, torch.Tensor) and value.is_nested:
        rows = value.unbind()
        if all(r.shape == rows[0].shape for r in rows):
            return torch.stack(rows)
    return value


def get_trajectories(
    partition: str, keys: Sequence[str], select_fields: Sequence[str] | None = None
) -> dict[str, torch.Tensor | list[Any]]:
    """Read trajectory rows in ``sorted(keys)`` order (arrival order from several workers varies, so
    determinism needs a fixed order); tensors batch dim first. Raises KeyError for absent keys, which TQ
    itself would silently drop."""
    import transfer_queue as tq

    ordered = sorted(keys)
    if len(set(ordered)) != len(ordered):
        raise ValueError("get_trajectories: duplicate keys")
    if not ordered:
        return {}
    fields = list(select_fields) if select_fields else None
    try:
        data = _guarded("get_trajectories", tq.kv_batch_get, keys=ordered, partition_id=partition, select_fields=fields)
    except ValueError:  # TQ's "keys or partition were not found!" (none there) or "fields not ready"
        _raise_if_missing(partition, ordered)
        raise
    if data.batch_size[0] != len(ordered):  # TQ drops absent keys with only a warning in the controller log
        _raise_if_missing(partition, ordered)
        raise KeyError(f"TransferQueue returned {data.batch_size[0]} of {len(ordered)} rows from {partition!r}")
    return {name: _densify(data.get(name)) for name in sorted(data.keys())}


def _raise_if_missing(partition: str, keys: list[str]) -> None:
    present = list_rows(partition)
    missing = [k for k in keys if k not in present]
    if missing:
        raise KeyError(f"{len(missing)} of {len(keys)} trajectory keys not in partition {partition!r}: {missing[:5]}")


# ------------------------------------------------------------------------------------ listing, clear
def list_rows(partition: str) -> dict[str, dict[str, Any]]:
    """Every key of ``partition`` with its tag (prompt and trajectory rows); {} for an unknown partition."""
    import transfer_queue as tq

    return dict(_guarded("list_rows", tq.kv_list, partition_id=partition).get(partition, {}))


def clear(partition: str, keys: Sequence[str]) -> None:
    """Remove rows (tags and data); unknown keys are ignored."""
    import transfer_queue as tq

    keys = list(keys)
    if keys:
        _guarded("clear", tq.kv_clear, keys=keys, partition_id=partition)


def clear_partition(partition: str) -> int:
    """Remove every row of ``partition`` (stale rows before a retried epoch, and at the end of a run).
    Returns how many were removed. Raises TransferQueueUnavailableError when a TransferQueue actor died
    (its requests would otherwise wait forever: a run's close would hang)."""
    keys = list(list_rows(partition))
    clear(partition, keys)
    return len(keys)
