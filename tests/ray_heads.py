"""Real Ray clusters for tests, built the way a user builds one: `ray start --head` and, for more nodes,
`ray start --address=<head>` raylets on this machine, each with its own `--num-cpus`, `--resources`, temp
dir and environment (a node's raylet passes its environment, e.g. HOME, and its working directory to its
workers, as on a real host). `ray_cluster` starts them, waits until each has registered with the head, and
stops them again by pid, checking that no process of theirs outlived them.

Every port a node would take by default (the dashboard's 8265, its agent's 52365, Ray Client's 10001, ...)
is a free one instead, so that these clusters and others on the machine never collide.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# `ray start` prints this once its node has registered with the cluster's GCS (ray._private.node waits for it).
STARTED_LINE = "Ray runtime started."
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 120.0
START_ATTEMPTS = 2


@dataclass(frozen=True)
class RayNode:
    """One node: what its `ray start` declares, and what its raylet's environment adds or changes."""

    num_cpus: int = 16
    resources: Mapping[str, float] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None


class _StartedNode:
    """One `ray start --block` process; a thread drains its output (so a full pipe never stalls it)."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: str | None, temp_dir: str):
        self.temp_dir = temp_dir
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", *args],
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_started(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(STARTED_LINE in line for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start did not start a node in {timeout_s:.0f}s:\n{''.join(self.lines)[-3000:]}")
            time.sleep(0.2)


@dataclass(frozen=True)
class StartedCluster:
    """A running cluster: the head's GCS address, and the environment a process that joins it needs."""

    address: str
    # The caller's environment with the cluster's token and without RAY_ADDRESS / RAY_AUTH_MODE: a client
    # as a user starts it (OmniFlow picks the auth mode itself).
    client_env: dict[str, str]
    auth_mode: str
    dashboard_url: str | None
    temp_dirs: tuple[str, ...]
    nodes: tuple[_StartedNode, ...] = field(repr=False, default=())

    def health(self) -> str:
        """Each node's `ray start` process, running or not, with its last output lines: for failure messages."""
        return "\n".join(
            f"node {i} ({'running' if n.proc.poll() is None else f'exited {n.proc.returncode}'}):\n{''.join(n.lines[-15:])}"
            for i, n in enumerate(self.nodes)
        )

    @property
    def tool_env(self) -> dict[str, str]:
        """`client_env` in the cluster's auth mode: for Ray's own clients (state API, `ray status`), which do
        not probe the mode as OmniFlow does."""
        return {**self.client_env, "RAY_AUTH_MODE": self.auth_mode}


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports: each socket stays bound until all are chosen (one at a time, the OS may hand
    out a just-released port again; Ray refuses a node whose components were given the same port)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def processes_of(temp_dir: str) -> list[int]:
    """Pids of live processes whose command line names `temp_dir` (a node's GCS, raylet, agents, workers)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and temp_dir.encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:  # gone meanwhile
            pass
    return pids


def _node_args(node: RayNode, temp_dir: str, ports: list[int]) -> list[str]:
    """`ray start` arguments of `node`; `ports` (4 free ones) for its agents and metrics."""
    agent_http, agent_grpc, metrics, runtime_env = ports
    args = [
        "--node-ip-address=127.0.0.1",
        f"--num-cpus={node.num_cpus}",
        f"--temp-dir={temp_dir}",
        f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={runtime_env}",
        "--disable-usage-stats",
    ]
    if node.resources:
        args.append(f"--resources={json.dumps(dict(node.resources))}")
    return args


@contextlib.contextmanager
def ray_cluster(
    head: RayNode = RayNode(),
    workers: Sequence[RayNode] = (),
    auth_mode: str = "token",
    include_dashboard: bool = False,
) -> Iterator[StartedCluster]:
    """A head (and `workers` joined to it) on 127.0.0.1 with Ray auth `auth_mode`; stopped on exit.

    The nodes and the clients share one token, given in the environment (nothing is written to ~/.ray); a
    node checks it only in token mode. Each node has its own short temp dir under /tmp (Ray's socket paths
    must stay under 107 bytes); `ray start --block` stops its node's processes on SIGTERM, and what is still
    alive a minute later is killed and reported as a failure (unless the body already failed).
    """
    client_env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    client_env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_TOKEN=uuid.uuid4().hex)
    started: list[_StartedNode] = []
    try:
        address, dashboard_port = "", None
        for i, node in enumerate([head, *workers]):
            for attempt in range(START_ATTEMPTS):
                ports = free_ports(7)  # 4 for the node's agents and metrics; GCS, dashboard, Ray Client of a head
                temp_dir = tempfile.mkdtemp(prefix=f"rn{i}", dir="/tmp")
                args = _node_args(node, temp_dir, ports[:4])
                if i == 0:
                    address, dashboard_port = f"127.0.0.1:{ports[4]}", ports[5]
                    args += ["--head", f"--port={ports[4]}", f"--ray-client-server-port={ports[6]}"]
                    args += [f"--include-dashboard={str(include_dashboard).lower()}"]
                    args += [f"--dashboard-port={dashboard_port}", "--dashboard-host=127.0.0.1"] if include_dashboard else []
                else:
                    args.append(f"--address={address}")
                env = {**client_env, "RAY_AUTH_MODE": auth_mode, **node.env}
                started.append(_StartedNode(args, env, node.cwd, temp_dir))
                try:
                    started[-1].wait_started(START_TIMEOUT_S)  # a worker joins only a head that runs
                    break
                except RuntimeError:
                    # Ray gives a raylet 30 s to register: on 2 busy cores it may miss that once. Another try.
                    if attempt == START_ATTEMPTS - 1:
                        raise
                    _stop([started.pop()])
        dashboard = f"http://127.0.0.1:{dashboard_port}" if include_dashboard else None
        yield StartedCluster(address, client_env, auth_mode, dashboard, tuple(n.temp_dir for n in started), tuple(started))
    finally:
        leftover = _stop(started)
    if leftover:
        raise AssertionError(f"processes of the test cluster outlived it: {leftover}")


def _stop(nodes: list[_StartedNode]) -> list[int]:
    """Stop the nodes, workers before the head; returns the pids that had to be killed."""
    for node in reversed(nodes):
        node.proc.terminate()
        try:
            node.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            node.proc.kill()
            node.proc.wait(timeout=30)
    deadline = time.monotonic() + 60
    while any(processes_of(n.temp_dir) for n in nodes) and time.monotonic() < deadline:
        time.sleep(0.5)
    leftover = [pid for n in nodes for pid in processes_of(n.temp_dir)]
    for pid in leftover:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    for node in nodes:
        shutil.rmtree(node.temp_dir, ignore_errors=True)
    return leftover
