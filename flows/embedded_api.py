"""The embedded Prefect API of a CLI run: one local server (SQLite, 127.0.0.1) for the whole run.

Prefect's ephemeral mode starts a temporary server in every process that needs one, and every Ray
worker would start its own (docs/design.md section 7). So when no `PREFECT_API_URL` is set, the run starts
`prefect server start` on a free loopback port with a persistent `PREFECT_HOME` in the output folder,
points this process (and through it every Ray worker) at it, and stops it at the end. A user's
`PREFECT_API_URL` wins. Call `embedded_prefect_api` before importing prefect. `EmbeddedApi.watch` tells
the runner when the server dies mid-run (the runner then stops the run: see `runner.stop_after_api_death`).

A server on a new `PREFECT_HOME` spends most of its start creating its SQLite database (Prefect's
migrations: ~7 of ~12 s on 2 cores). The first such start on a machine keeps a copy of the new, empty database
(`sqlite3` backup, taken once the server answers and before the run writes anything) in
`OMNIFLOW_CACHE_DIR` (default `~/.cache/omniflow`), one per Prefect version; later servers on a new home
start from that copy, and Prefect's migrate-on-start finds it at head.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

DEFAULT_HOME = Path("outputs") / "prefect"
CACHE_DIR_ENV = "OMNIFLOW_CACHE_DIR"
DB_NAME = "prefect.db"
# Settings that move Prefect's database away from PREFECT_HOME/prefect.db: then no template is used or kept.
DATABASE_URL_ENVS = ("PREFECT_API_DATABASE_CONNECTION_URL", "PREFECT_SERVER_DATABASE_CONNECTION_URL")
LEASE_STORAGE_ENV = "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE"
FILE_LEASE_STORAGE = "prefect.server.concurrency.lease_storage.filesystem"


def template_database() -> Path | None:
    """Where the empty, migrated database of this Prefect version is kept; None when the server's database is not
    the SQLite file in PREFECT_HOME (a connection URL is set)."""
    if any(os.environ.get(name) for name in DATABASE_URL_ENVS):
        return None
    from importlib.metadata import version

    cache = Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "omniflow")
    return cache / "prefect-db" / version("prefect") / DB_NAME


def _keep_template(db: Path, template: Path) -> None:
    """Copy the server's new database to `template` (atomically: a temporary file, then a rename)."""
    template.parent.mkdir(parents=True, exist_ok=True)
    partial = template.with_name(f".{template.name}.{os.getpid()}")
    with contextlib.closing(sqlite3.connect(db)) as src, contextlib.closing(sqlite3.connect(partial)) as dst:
        src.backup(dst)
    os.replace(partial, template)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prefect_executable() -> list[str]:
    exe = Path(sys.executable).with_name("prefect")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "prefect"]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the embedded Prefect server exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"the embedded Prefect server at {url} was not healthy after {timeout_s:.0f}s")


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM when this process dies, even by SIGKILL or abort (no orphan)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EmbeddedApi:
    """The run's API: `url`, and `wait_ready()` (the server boots while the caller imports the flow)."""

    def __init__(self, url: str | None, server: PrefectServer | None = None, timeout_s: float = 120.0):
        self.url, self.server, self.timeout_s = url, server, timeout_s
        self.proc: subprocess.Popen | None = server.proc if server is not None else None

    @property
    def ui_url(self) -> str | None:
        return self.url.removesuffix("/api") if self.url else None

    def wait_ready(self) -> None:
        if self.server is not None:  # a user's PREFECT_API_URL: their server, ready or not
            self.server.wait_ready(self.timeout_s)

    @contextlib.contextmanager
    def watch(self, on_exit: Callable[[int], object], poll_s: float = 0.5) -> Iterator[None]:
        """Within: `on_exit(returncode)` runs (in a daemon thread) if the embedded server exits, killed or crashed.

        Nothing is watched for a user's `PREFECT_API_URL`: their server, their restarts. Leaving the `with`
        stops the watch before `embedded_prefect_api` stops the server on purpose.
        """
        if self.proc is None:
            yield
            return
        proc, done = self.proc, threading.Event()

        def poll() -> None:
            while not done.wait(poll_s):
                code = proc.poll()
                if code is not None:
                    if not done.is_set():
                        on_exit(code)
                    return

        thread = threading.Thread(target=poll, name="omniflow-prefect-api-watch", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join(timeout=4 * poll_s)


class PrefectServer:
    """`prefect server start` on a free loopback port with its own PREFECT_HOME (SQLite), as a subprocess.

    Its own process group, and SIGTERM when this process dies (even by SIGKILL): no orphan server.
    Changes nothing in this process's environment; `embedded_prefect_api` does that for a run.
    """

    def __init__(self, home: str | Path, port: int | None = None):
        self.home = Path(home).resolve()
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.proc: subprocess.Popen | None = None
        self._log = None
        self.seeded = False  # started from the template database
        self._keep_as_template: Path | None = None  # a new database to copy once the server answers

    @property
    def ui_url(self) -> str:
        return self.url.removesuffix("/api")

    def start(self) -> PrefectServer:
        db, template = self.home / DB_NAME, template_database()
        if template is not None and not db.exists():
            if template.is_file():
                shutil.copyfile(template, db)
                self.seeded = True
            else:
                self._keep_as_template = template
        env = {**os.environ, "PREFECT_HOME": str(self.home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
        env.pop("PREFECT_API_URL", None)
        # Concurrency leases (GPU slots: tasks/gpu_slots.py) in files under PREFECT_HOME, not in the server's memory:
        # the database keeps a limit's active slots across restarts, so with leases in memory a slot held by a run
        # killed together with its server would stay taken for good; from files, the next server expires it.
        env.setdefault(LEASE_STORAGE_ENV, FILE_LEASE_STORAGE)
        # The bundled UI calls the API at this URL (its default is port 4200, whatever --port says).
        env["PREFECT_UI_API_URL"] = env["PREFECT_SERVER_UI_API_URL"] = self.url
        self._log = open(self.home / "server.log", "ab")  # noqa: SIM115  (closed in stop)
        self.proc = subprocess.Popen(
            [*_prefect_executable(), "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so stopping it stops its children too
            preexec_fn=_die_with_parent,
        )
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        assert self.proc is not None, "start() first"
        _wait_healthy(self.url, self.proc, timeout_s)
        # The first server on a new database on this machine keeps a copy of it, before the run writes anything.
        template, self._keep_as_template = self._keep_as_template, None
        if template is not None and not template.exists():
            with contextlib.suppress(OSError, sqlite3.Error):  # a cache that cannot be written costs only time
                _keep_template(self.home / DB_NAME, template)

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()
        self.proc = None


@contextlib.contextmanager
def embedded_prefect_api(home: Path | None = None, timeout_s: float = 120.0) -> Iterator[EmbeddedApi]:
    """The run's Prefect API: the user's `PREFECT_API_URL`, or a server started here (and stopped at exit).

    Sets `PREFECT_API_URL` / `PREFECT_HOME` in this process before yielding, so prefect may be imported
    while the server is still booting; call `wait_ready()` before the first API call.
    """
    if os.environ.get("PREFECT_API_URL"):
        yield EmbeddedApi(os.environ["PREFECT_API_URL"])
        return
    server = PrefectServer(os.environ.get("PREFECT_HOME") or home or DEFAULT_HOME).start()
    os.environ["PREFECT_HOME"] = str(server.home)
    os.environ["PREFECT_API_URL"] = server.url
    try:
        yield EmbeddedApi(server.url, server, timeout_s)
    finally:
        # PREFECT_API_URL stays set: a late Prefect call should fail to connect, not start an
        # ephemeral server of its own that would outlive the run.
        _drain_prefect_workers()
        server.stop()


def _drain_prefect_workers() -> None:
    """Send queued logs and events before the server goes away (as prefect_test_harness does)."""
    if "prefect" not in sys.modules:
        return
    with contextlib.suppress(Exception):
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=10)
        EventsWorker.drain_all(timeout=10)
