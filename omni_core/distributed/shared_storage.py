"""Every node of a multi-node Ray cluster must see the run's checkpoint folder and the files it loads
(docs/design.md section 2): `check_shared_storage` proves it at start, before anything of the run is submitted.

The checkpoint folder is `trainer.checkpoint_dir` as each process resolves it (`~` to that process's home, a
relative path against its working directory), which is how the run's own tasks and actors resolve it. So
the driver (this process: it holds the run's lock there and reads the checkpoints it resumes) and one tiny
Ray task per alive node (`num_cpus=0`, pinned to the node) each write a probe file there; then each opens
every probe file by name, and reads `model_index.json` of `actor_rollout_ref.model.path` and the reward
files. A participant that misses one fails the run with a `ConfigError` naming the key, the folder and the
node (id and IP) that cannot see it, and the fix; the probe files (and folders the probe had to create) are
removed again either way. A single-node cluster has nothing to compare and is skipped at the cost of one
`ray.nodes()` call.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from omni_core.config import ConfigError, ConfigProblem, OmniFlowConfig
from omni_core.models.hub import TRANSFORMERS_SKIP, is_hub_id, resolve_model_path
from omni_core.models.model_index import ModelLoadError
from omni_core.rewards.entries import entry_kind

PROBE_PREFIX = ".omniflow-storage-probe-"
PROBE_TASK_NAME = "omniflow-shared-storage-probe"
PROBE_TIMEOUT_S = 120.0
SHARED_STORAGE_FIX = (
    "every node must see the same folder at the same path: put it on a shared filesystem mounted on all nodes "
    "(NFS, a Kubernetes PersistentVolumeClaim with accessModes ReadWriteMany, a cloud file store such as EFS / "
    "Filestore / Azure Files), and give it as an absolute path"
)


@dataclass(frozen=True)
class Participant:
    """The driver or one Ray node: who takes part in the probe, and how a message names it."""

    node_id: str | None  # None: the driver (this process)
    ip: str

    def __str__(self) -> str:
        return f"node {self.node_id} ({self.ip})" if self.node_id else f"the driver (this process, on {self.ip})"


@dataclass(frozen=True)
class Written:
    """What a participant's write round did: its resolved folder, its probe file's name, or why it failed."""

    folder: str
    probe: str | None
    created: str | None  # the topmost folder the probe had to create (removed again if empty)
    error: str | None


@dataclass(frozen=True)
class Seen:
    """What a participant's read round found: the probe files it sees and the files it could not read."""

    probes: frozenset[str]
    unreadable: tuple[tuple[str, str, str], ...]  # (key, path, error)


# ----------------------------------------------------------------------------- the three rounds (any process)
def write_probe(trainer: Any, token: str) -> Written:
    """Create the checkpoint folder as this process resolves it (if needed) and write a probe file into it."""
    folder = Path(os.path.abspath(trainer.checkpoint_dir))
    created = next((p for p in reversed([folder, *folder.parents]) if not p.exists()), None)
    name = f"{PROBE_PREFIX}{token}-{uuid.uuid4().hex[:12]}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(name)
    except OSError as exc:
        return Written(str(folder), None, str(created) if created else None, f"{type(exc).__name__}: {exc}")
    return Written(str(folder), name, str(created) if created else None, None)


def look(trainer: Any, probes: Sequence[str], files: Sequence[tuple[str, str]]) -> Seen:
    """Which of the `probes` (file names) this process reads back from its checkpoint folder, and which of
    `files` ((key, path) pairs) it cannot read.

    Each probe is opened by name, never found by listing the folder: an NFS client may answer a listing from
    its attribute cache for half a minute, while a lookup by a name it never saw asks the server."""
    folder = Path(os.path.abspath(trainer.checkpoint_dir))
    seen = []
    for name in probes:
        with contextlib.suppress(OSError):
            if (folder / name).read_text() == name:
                seen.append(name)
    unreadable = []
    for key, path in files:
        try:
            with open(Path(path).expanduser(), "rb") as f:
                f.read(1)
        except OSError as exc:
            unreadable.append((key, os.path.abspath(Path(path).expanduser()), f"{type(exc).__name__}: {exc.strerror or exc}"))
    return Seen(frozenset(seen), tuple(unreadable))


def remove_probe(written: Written) -> None:
    """Remove this process's probe file, then the folders the probe created, as far as they are empty."""
    folder = Path(written.folder)
    if written.probe:
        with contextlib.suppress(OSError):
            (folder / written.probe).unlink()
    if written.created:
        top = Path(written.created)
        for path in [folder, *folder.parents]:
            with contextlib.suppress(OSError):
                path.rmdir()  # only an empty folder goes
            if path == top:
                break


# ------------------------------------------------------------------------------------------- the check
def files_every_node_reads(config: OmniFlowConfig) -> list[tuple[str, str]]:
    """(key, file) pairs that the run's workers open on whichever node they run: the model's
    model_index.json (the folder is loaded there), the reward files, and the model rewards' folders and heads
    (a server term or verl-omni's HTTP client entry opens no file)."""
    model = config.actor_rollout_ref.model
    files = [("actor_rollout_ref.model.path", str(_cached_folder(model.path, model.revision) / "model_index.json"))]
    custom = config.reward.custom_reward_function.path
    if custom:
        files.append(("reward.custom_reward_function.path", custom))
    for i, spec in enumerate(config.reward.reward_functions):
        key = f"reward.reward_functions[{i}]"
        kind = entry_kind(spec.model_dump())
        if kind == "file":
            files.append((f"{key}.path", spec.path))
        elif kind == "model":
            files.append(
                (f"{key}.model_path", str(_cached_folder(spec.model_path, spec.revision, TRANSFORMERS_SKIP) / "config.json"))
            )
            if spec.head_path:
                files.append((f"{key}.head_path", spec.head_path))
    return files


def _cached_folder(path: str, revision: str | None, skip: list[str] | None = None) -> Path:
    # A Hub id is read where the driver's Hugging Face cache holds it: several nodes need that cache on shared
    # storage (or the model downloaded into each node's cache at the same path); one not cached yet stays as written.
    if not is_hub_id(path):
        return Path(path)  # as written: each node expands `~` itself, as its workers will
    try:
        return resolve_model_path(path, revision, skip=skip, download=False)
    except ModelLoadError:
        return Path(path)


def alive_nodes() -> list[Participant]:
    """The cluster's alive nodes, by node id."""
    nodes = [Participant(n["NodeID"], n["NodeManagerAddress"]) for n in ray.nodes() if n.get("Alive")]
    return sorted(nodes, key=lambda n: n.node_id or "")


def check_shared_storage(config: OmniFlowConfig, timeout_s: float = PROBE_TIMEOUT_S) -> int:
    """Raise ConfigError unless the driver and every alive node see the same checkpoint folder and can read
    the run's model and reward files; returns the number of nodes checked (0: single node, skipped).

    A node that does not run its probe task within `timeout_s` raises TimeoutError (an infrastructure
    failure: the task that called this may be retried)."""
    nodes = alive_nodes()
    if len(nodes) < 2:
        return 0
    driver = Participant(None, ray.util.get_node_ip_address())
    token, trainer, files = uuid.uuid4().hex[:12], config.trainer, files_every_node_reads(config)
    written: dict[Participant, Written] = {driver: write_probe(trainer, token)}
    try:
        written.update(_on_nodes(nodes, write_probe, lambda n: (trainer, token), timeout_s))
        probes = sorted(w.probe for w in written.values() if w.probe)
        seen = {driver: look(trainer, probes, files), **_on_nodes(nodes, look, lambda n: (trainer, probes, files), timeout_s)}
    finally:  # the nodes first: a folder the driver's probe created goes last, once empty
        _on_nodes([n for n in nodes if n in written], remove_probe, lambda n: (written[n],), timeout_s)
        remove_probe(written[driver])
    problems = _folder_problems(config, driver, written, seen) + _file_problems(seen)
    if problems:
        raise ConfigError(problems)
    return len(nodes)


def _on_nodes(nodes: Sequence[Participant], fn: Any, args_of: Any, timeout_s: float) -> dict[Participant, Any]:
    """`fn(*args_of(node))` as one Ray task pinned to each node; {node: result}."""
    remote = ray.remote(num_cpus=0, max_retries=0)(fn)
    refs = {
        node: remote.options(
            name=PROBE_TASK_NAME, scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)
        ).remote(*args_of(node))
        for node in nodes
    }
    results = {}
    for node, ref in refs.items():
        try:
            results[node] = ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            # The probes that did not run are left to end with the run (no ray.cancel: cancelling a task whose reply
            # is being handled aborts the process in Ray 2.60; omni_core.distributed.run_control says why).
            raise TimeoutError(
                f"{node} did not run OmniFlow's shared-storage probe (a task with no CPU reservation) within "
                f"{timeout_s:.0f}s; check that the node is healthy (`ray status`)"
            ) from None
    return results


def _folder_problems(
    config: OmniFlowConfig, driver: Participant, written: dict[Participant, Written], seen: dict[Participant, Seen]
) -> list[ConfigProblem]:
    """Who cannot write the checkpoint folder, and which nodes see another folder than the driver does."""
    key, value = "trainer.default_local_dir", config.trainer.default_local_dir
    problems = [
        ConfigProblem(key, f"{who} cannot write the checkpoint folder {w.folder} ({w.error}); {SHARED_STORAGE_FIX}", value)
        for who, w in written.items()
        if w.error
    ]
    probes = {who: w.probe for who, w in written.items() if w.probe}
    # The driver reads the checkpoints it resumes from and holds the run's lock there: its view is the reference.
    sharing = {who for who in seen if seen[who].probes == seen[driver].probes and probes.get(who) in seen[driver].probes}
    apart = [who for who in seen if who not in sharing and not written[who].error]
    hint = _per_node_path_hint(value)
    if apart and sharing == {driver}:  # no node sees the driver's folder: name the driver, not every node
        problems.append(
            ConfigProblem(
                key,
                f"{driver} does not see the checkpoint folder that the Ray nodes write to: no node's probe file is "
                f"visible in {written[driver].folder}, where the driver resolves it{hint}; {SHARED_STORAGE_FIX}",
                value,
            )
        )
        return problems
    for who in apart:
        problems.append(
            ConfigProblem(
                key,
                f"{who} cannot see the checkpoint folder {written[driver].folder} that the driver uses: a probe file "
                f"written there is not visible on that node, which resolves the folder to {written[who].folder}"
                f"{hint}; {SHARED_STORAGE_FIX}",
                value,
            )
        )
    return problems


def _per_node_path_hint(value: str | None) -> str:
    if value is None:
        return " (trainer.default_local_dir is unset: checkpoints/<project>/<experiment> relative to each process's working directory)"
    if value.startswith("~") or not os.path.isabs(value):
        return f" ({value} resolves per node: `~` to each node's home, a relative path against each process's working directory)"
    return ""


def _file_problems(seen: dict[Participant, Seen]) -> list[ConfigProblem]:
    """One problem per (key, file): the participants that cannot read it."""
    missing: dict[tuple[str, str], list[str]] = {}
    errors: dict[tuple[str, str], str] = {}
    for who, s in seen.items():
        for key, path, error in s.unreadable:
            missing.setdefault((key, path), []).append(str(who))
            errors.setdefault((key, path), error)
    return [
        ConfigProblem(key, f"{', '.join(who)} cannot read {path} ({errors[(key, path)]}); {SHARED_STORAGE_FIX}")
        for (key, path), who in missing.items()
    ]
