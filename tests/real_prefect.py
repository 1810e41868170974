"""Helpers of the real-server tests: a `prefect server start` per test module, CLI calls against it,
served / worker subprocesses, and bounded waits on flow runs through the API."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def server_env(url: str, home: Path, **extra: str) -> dict[str, str]:
    """Environment of a process that talks to the server at `url` (and only to it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_API_URL=url,
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="1",
        RAY_USAGE_STATS_ENABLED="0",
        PREFECT_WORKER_QUERY_SECONDS="2",
        PREFECT_RUNNER_POLL_FREQUENCY="2",
        **extra,
    )
    return env


def prefect_command() -> list[str]:
    """The `prefect` command of this interpreter: its script beside it, or `python -m prefect` (a virtual environment
    that sees prefect in the system's site packages has no script of its own)."""
    exe = Path(sys.executable).with_name("prefect")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "prefect"]


def prefect_cli(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = prefect_command()
    return subprocess.run([*cmd, "--no-prompt", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def start_process(cmd: list[str], env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen:
    """A long-lived child (serve, a worker) in its own process group, output to `log`."""
    return subprocess.Popen(
        cmd,
        env=env,
        cwd=cwd,
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # noqa: SIM115
    )


def stop_process(proc: subprocess.Popen, timeout: float = 30) -> int:
    """SIGTERM the process group (as systemd / Kubernetes stop a service), then SIGKILL if it lingers."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(timeout=10)


def wait_gone(processes: list[Any], timeout_s: float) -> None:
    """Poll until none of `processes` (psutil.Process) runs any more, zombies counting as gone; fail with
    the ones left once `timeout_s` has passed."""
    import psutil

    def alive() -> list[str]:
        left = []
        for p in processes:
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{p.pid}: {' '.join(p.cmdline())[:120]}")
        return left

    deadline = time.monotonic() + timeout_s
    while alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    left = alive()
    assert not left, f"still running {timeout_s:.0f}s later: {left}"


@contextlib.contextmanager
def api(url: str) -> Iterator[Any]:
    """A sync Prefect client of the server at `url` (the test session's harness stays untouched)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: url}), get_client(sync_client=True) as client:
        yield client


def wait_final(url: str, flow_run_id: Any, timeout_s: float, log: Path | None = None) -> Any:
    """The flow run once it is in a final state; fails with the serving process's log tail otherwise."""
    deadline = time.monotonic() + timeout_s
    with api(url) as client:
        while time.monotonic() < deadline:
            run = client.read_flow_run(flow_run_id)
            if run.state and run.state.type.value in FINAL:
                return run
            time.sleep(1.0)
    tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
    raise AssertionError(f"flow run {flow_run_id} not finished after {timeout_s:.0f}s (state {run.state}); log tail:\n{tail}")


def deployment(client: Any, flow_name: str, name: str) -> Any:
    return client.read_deployment_by_name(f"{flow_name}/{name}")


def run_log_messages(flow_run_id: Any, until: str, timeout_s: float = 60) -> list[str]:
    """Every log message of the flow run and its subflows, all pages, in the current Prefect API (the session's
    harness unless a test points elsewhere), once one holds `until` or `timeout_s` has passed: a Ray worker's task
    sends its log lines to the API in batches, a moment after the run may have ended."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId, LogFilter, LogFilterFlowRunId

    async def read() -> list[str]:
        async with get_client() as client:
            ids, todo = [], [flow_run_id]
            while todo:
                current = todo.pop()
                ids.append(current)
                children = await client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[current]))
                )
                todo.extend(r.id for r in children)
            messages: list[str] = []
            while True:
                page = await client.read_logs(
                    log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=ids)), limit=200, offset=len(messages)
                )
                messages += [log.message for log in page]
                if len(page) < 200:
                    return messages

    deadline = time.monotonic() + timeout_s
    while True:
        messages = asyncio.run(read())
        if any(until in m for m in messages) or time.monotonic() > deadline:
            return messages
        time.sleep(1.0)
