"""A training run as a job on an existing Ray cluster, through Ray's job API (the head's dashboard address, e.g.
`http://head:8265`): the entrypoint and runtime environment the run needs, submitting it, following its logs as
they come, and stopping it.

The job's driver is `omniflow train <overrides> ray_kwargs.ray_init.address=auto`: inside a Ray job `RAY_ADDRESS`
names the cluster the job runs on, which is what `address=auto` resolves to (`ray_auth.gcs_address_of`), and the
driver joins it in the cluster's auth mode (`ray_cluster.connect_ray`). The job reports to the Prefect API it is
given in its `runtime_env` (`PREFECT_API_URL`), so the training shows there as a flow run of its own.

Token auth: the dashboard of a cluster started with `RAY_AUTH_MODE=token` answers only requests that carry the
cluster's token. The client sends the token this process has (`RAY_AUTH_TOKEN`, the file `RAY_AUTH_TOKEN_PATH`
names, or `~/.ray/auth_token`, the places Ray itself reads) whether or not this process runs in token mode, so a
submitter needs no Ray auth setting of its own; a cluster without auth ignores the header.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import shlex
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRAIN_COMMAND = ("omniflow", "train")
ADDRESS_KEY = "ray_kwargs.ray_init.address"
# The job's driver joins the cluster the job runs on (RAY_ADDRESS, set by Ray's job supervisor).
JOIN_THE_JOBS_CLUSTER = f"{ADDRESS_KEY}=auto"
# Environment variables of the submitting process that the job gets too (a Prefect Cloud key, a server's basic
# auth, offline model hubs); PREFECT_API_URL is given explicitly. A job's own runtime_env env_vars win.
JOB_PASSED_ENV_VARS = ("PREFECT_API_KEY", "PREFECT_API_AUTH_STRING", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
# Python buffers a piped stdout in 8 KB blocks: the job's log lines would arrive in bursts, minutes late.
UNBUFFERED = {"PYTHONUNBUFFERED": "1"}
TERMINAL_STATUSES = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})
# The metadata key that ties a job to the Prefect flow run that submitted it (`stop_jobs_with_metadata`).
FLOW_RUN_METADATA = "prefect_flow_run_id"
# How often `follow_job` asks for the job's status, and how long it waits for the log stream to end after that.
STATUS_POLL_S = 1.0
TAIL_END_WAIT_S = 10.0
# How long `stop_job` waits for a stopped job to reach a final status.
STOP_WAIT_S = 60.0


@dataclass(frozen=True)
class JobOutcome:
    """How a job ended: its submission id, final status (`SUCCEEDED`, `FAILED`, `STOPPED`) and Ray's message."""

    job_id: str
    status: str
    message: str | None

    @property
    def succeeded(self) -> bool:
        return self.status == "SUCCEEDED"


def train_entrypoint(overrides: Sequence[str] = (), config_files: Sequence[str] = ()) -> str:
    """The job's shell command: `omniflow train FILE... key=value... ray_kwargs.ray_init.address=auto`.

    The job always joins the cluster it runs on; an override naming another address is refused."""
    for override in overrides:
        key, _, value = override.partition("=")
        if key.strip() == ADDRESS_KEY and value.strip() != "auto":
            raise ValueError(
                f"{override}: a Ray job's training joins the cluster the job runs on ({JOIN_THE_JOBS_CLUSTER}); "
                f"drop the override and give that cluster's dashboard address to the job instead"
            )
    kept = [o for o in overrides if o.partition("=")[0].strip() != ADDRESS_KEY]
    return shlex.join([*TRAIN_COMMAND, *config_files, *kept, JOIN_THE_JOBS_CLUSTER])


def job_runtime_env(runtime_env: Mapping[str, Any] | None, prefect_api_url: str | None) -> dict[str, Any]:
    """The job's `runtime_env`: the user's, with `env_vars` merged over ours (`PREFECT_API_URL`, the
    `JOB_PASSED_ENV_VARS` set in this process, `PYTHONUNBUFFERED`); on a clash the user's value wins, and the
    user's other keys (pip, working_dir, ...) pass through as given."""
    env = dict(runtime_env or {})
    ours = {k: os.environ[k] for k in JOB_PASSED_ENV_VARS if k in os.environ} | UNBUFFERED
    if prefect_api_url:
        ours["PREFECT_API_URL"] = prefect_api_url
    env["env_vars"] = {**ours, **dict(env.get("env_vars") or {})}
    return env


def auth_token() -> str | None:
    """This process's Ray auth token, from where Ray reads one: `RAY_AUTH_TOKEN`, the file in
    `RAY_AUTH_TOKEN_PATH`, `~/.ray/auth_token`; None when there is none."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    for path in (os.environ.get("RAY_AUTH_TOKEN_PATH"), Path.home() / ".ray" / "auth_token"):
        with contextlib.suppress(OSError, TypeError):
            token = Path(path).read_text().strip()  # type: ignore[arg-type]
            if token:
                return token
    return None


def job_client(address: str) -> Any:
    """A `JobSubmissionClient` for the dashboard at `address` (`http://host:8265`), carrying the token if any."""
    from ray.job_submission import JobSubmissionClient

    token = auth_token()
    return JobSubmissionClient(address, headers={"Authorization": f"Bearer {token}"} if token else None)


def submit_job(
    client: Any, entrypoint: str, runtime_env: Mapping[str, Any], submission_id: str, metadata: Mapping[str, str]
) -> str:
    """Submit `entrypoint`; returns the job's submission id."""
    return client.submit_job(
        entrypoint=entrypoint, runtime_env=dict(runtime_env), submission_id=submission_id, metadata=dict(metadata)
    )


def job_status(client: Any, job_id: str) -> str:
    """The job's status as a plain string (`PENDING`, `RUNNING`, `SUCCEEDED`, `FAILED`, `STOPPED`)."""
    return str(client.get_job_status(job_id).value)


class _LogTail(threading.Thread):
    """Ray's log stream of one job (`tail_job_logs`, a websocket) read on a thread of its own, in chunks put on
    `chunks`; the server closes the stream when the job ends. The caller's thread stays free for signals."""

    def __init__(self, client: Any, job_id: str):
        super().__init__(name=f"ray-job-logs-{job_id}", daemon=True)
        self.client, self.job_id = client, job_id
        self.chunks: queue.Queue[str] = queue.Queue()
        self.error: BaseException | None = None

    def run(self) -> None:
        async def tail() -> None:
            async for chunk in self.client.tail_job_logs(self.job_id):
                self.chunks.put(chunk)

        try:
            asyncio.run(tail())
        except BaseException as exc:  # a dropped connection: `follow_job` reads the logs by polling instead
            self.error = exc


class _Lines:
    """Chunks of text in, whole lines out to `on_line`; counts the characters seen."""

    def __init__(self, on_line: Callable[[str], None]):
        self.on_line, self.partial, self.seen = on_line, "", 0

    def feed(self, chunk: str) -> None:
        self.seen += len(chunk)
        *lines, self.partial = (self.partial + chunk).split("\n")
        for line in lines:
            self.on_line(line.rstrip("\r"))

    def flush(self) -> None:
        if self.partial:
            self.on_line(self.partial)
            self.partial = ""


def follow_job(client: Any, job_id: str, on_line: Callable[[str], None], status_poll_s: float = STATUS_POLL_S) -> JobOutcome:
    """Hand the job's log lines to `on_line` as they come, until the job reaches a final status; returns it.

    The lines come from Ray's log stream; if that stream drops, from `get_job_logs` at every status poll. Once the
    job has ended, the whole log is read once more and what the stream had not delivered is handed on, so every
    line arrives exactly once. The wait is in short slices: a signal (Ctrl-C, a runner's SIGTERM) is raised here
    promptly, and the caller stops the job (`stop_job`)."""
    tail = _LogTail(client, job_id)
    tail.start()
    lines = _Lines(on_line)

    def drain() -> None:
        with contextlib.suppress(queue.Empty):
            while True:
                lines.feed(tail.chunks.get_nowait())

    next_poll = 0.0
    while True:
        with contextlib.suppress(queue.Empty):
            lines.feed(tail.chunks.get(timeout=min(0.2, status_poll_s)))
        if time.monotonic() < next_poll:
            continue
        next_poll = time.monotonic() + status_poll_s
        if not tail.is_alive():  # the stream ended or dropped: read what is new by polling
            drain()
            logs = client.get_job_logs(job_id)
            lines.feed(logs[lines.seen :])
        info = client.get_job_info(job_id)
        if str(info.status.value) in TERMINAL_STATUSES:
            break
    tail.join(timeout=TAIL_END_WAIT_S)
    drain()
    logs = client.get_job_logs(job_id)
    lines.feed(logs[lines.seen :])
    lines.flush()
    return JobOutcome(job_id, str(info.status.value), info.message)


def stop_job(client: Any, job_id: str, wait_s: float = STOP_WAIT_S) -> str | None:
    """Stop the job (Ray sends its driver SIGTERM, then SIGKILL) and wait up to `wait_s` for a final status;
    returns the last status seen, None when the cluster does not know the job."""
    try:
        client.stop_job(job_id)
    except RuntimeError:  # no such job (or the dashboard refused): nothing of ours to stop
        return None
    deadline = time.monotonic() + wait_s
    status = job_status(client, job_id)
    while status not in TERMINAL_STATUSES and time.monotonic() < deadline:
        time.sleep(0.5)
        status = job_status(client, job_id)
    return status


def stop_jobs_with_metadata(client: Any, key: str, value: str, wait_s: float = STOP_WAIT_S) -> list[str]:
    """Stop every job on the cluster not yet ended whose metadata has `key` = `value` (the jobs a Prefect flow run
    submitted: `FLOW_RUN_METADATA`); returns their ids."""
    running = [
        j.submission_id
        for j in client.list_jobs()
        if (j.metadata or {}).get(key) == value and str(j.status.value) not in TERMINAL_STATUSES and j.submission_id
    ]
    for job_id in running:
        stop_job(client, job_id, wait_s)
    return running
