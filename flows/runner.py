"""Running OmniFlow from the command line: the one runner behind `omniflow train`,
`python -m omniflow.flows.main_diffusion_v1`, `python -m omniflow.flows.pipeline` and `omniflow serve`.

It owns what every command-line run needs, in this order:

  1. a quiet environment (telemetry off, model hubs offline, TransferQueue's chatter off);
  2. Ctrl-C and SIGTERM as `KeyboardInterrupt`, so every `finally` runs (the flow closes its
     TransferQueue and actors, the Ray cluster and the Prefect server it started are stopped, and
     the last checkpoint stays as it was);
  3. the run's Prefect API: the user's `PREFECT_API_URL`, or the embedded local server, with Prefect's
     settings pointed at it (Prefect reads them when first imported, which may be before the server
     exists) and the addresses printed where a newcomer sees them;
  4. the flow, called by its import path, so that its heavy imports overlap the server's boot;
  5. the outcome: exit 0 with the caller's report, 1 with the failed state's message, 130 when stopped,
     75 (EX_TEMPFAIL: try again) when the embedded Prefect API died mid-run (`stop_after_api_death`).

Light to import: nothing heavy is imported before it is used.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

QUIET_ENV = {
    "DO_NOT_TRACK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "RAY_DEDUP_LOGS": "0",
    "TQ_LOGGING_LEVEL": "ERROR",
}
# Exit code when the embedded Prefect API died mid-run (EX_TEMPFAIL: the same command again resumes).
EXIT_API_DIED = 75


def split_files_and_overrides(
    args: Sequence[str], config_path: str | None = None, config_name: str | None = None
) -> tuple[list[str], list[str]]:
    """verl-style argv -> (YAML files, overrides).

    Overrides are `key.path=value`, `+key=value`, `++key=value` and `~key` (delete); any other word is a YAML
    file. Hydra's `--config-path=DIR --config-name=NAME` (also `-cp` / `-cn`, as options here or as words of
    `args`, as `python -m omniflow.flows.main_diffusion_v1` gets them) name the first file, DIR/NAME.yaml.
    """
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--config-path", "-cp", default=config_path)
    parser.add_argument("--config-name", "-cn", default=config_name)
    ns, words = parser.parse_known_args(list(args))
    overrides = [a for a in words if "=" in a or (a.startswith("~") and a[1:2].isidentifier())]  # ~/x.yaml: a file
    files = [a for a in words if a not in overrides]
    if ns.config_name:
        from omni_core.config import config_name_file

        files.insert(0, str(config_name_file(ns.config_path, ns.config_name)))
    elif ns.config_path:
        from omni_core.config import ConfigError, ConfigProblem

        problem = ConfigProblem("--config-path", "names the folder of --config-name=NAME; give the config's name too")
        raise ConfigError([problem])
    return files, overrides


# Stop signals this process received. A signal that lands inside library code (an import, a pydantic
# serializer) can surface as that library's error and a Failed state instead of an interruption.
_stop_signals: list[int] = []
_INTERRUPTED = "interrupted; the last checkpoint is intact and the run's processes are stopped"


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    _stop_signals.append(signum)
    raise KeyboardInterrupt(f"signal {signum}")


def _was_stopped(state: Any) -> bool:
    """Whether a Failed `state` is really a Ctrl-C / SIGTERM that library code wrapped in its own error.

    Prefect's engine owns SIGTERM while the flow runs (its handler raises `TerminationSignal`, and hands the
    signal on to ours only when that exception reaches it); a signal landing inside a C call surfaces as that
    call's `SystemError` instead, with the `TerminationSignal` as its cause: the exception's chain tells."""
    from prefect.exceptions import TerminationSignal

    if _stop_signals or "TerminationSignal" in (state.message or ""):
        return True
    try:
        exc = state.result(raise_on_failure=False)
    except Exception:  # a result that cannot be read back: nothing to tell
        return False
    seen: set[int] = set()
    while isinstance(exc, BaseException) and id(exc) not in seen:
        if isinstance(exc, (TerminationSignal, KeyboardInterrupt)):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def prepare_process() -> None:
    """Steps 1 and 2: the quiet environment (a user's own settings win) and SIGTERM as Ctrl-C."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)


@contextlib.contextmanager
def prefect_api(command: str, warm_up: Callable[[], Any] | None = None) -> Iterator[Any]:
    """Step 3: the run's Prefect API for the body of the `with`; yields the `EmbeddedApi`.

    `warm_up` runs while an embedded server boots (e.g. importing the flow). The API's address and
    the UI's are printed; Prefect's settings point at it for the whole body.
    """
    from omniflow.flows.embedded_api import embedded_prefect_api

    with embedded_prefect_api() as api:
        if warm_up is not None:
            warm_up()
        api.wait_ready()
        print(f"{command}: Prefect API {api.url} (PREFECT_HOME={os.environ.get('PREFECT_HOME')})", flush=True)
        from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

        updates = {PREFECT_API_URL: api.url, PREFECT_HOME: os.environ["PREFECT_HOME"]} if api.proc else {}
        with temporary_settings(updates=updates):
            yield api


def load_flow(path: str) -> Any:
    """A flow object from `"package.module:flow_name"`."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def shutdown_ray() -> None:
    """Stop a Ray cluster this process still holds (an interrupted run may leave one)."""
    if "ray" not in sys.modules:
        return
    with contextlib.suppress(Exception):
        import ray

        if ray.is_initialized():
            ray.shutdown()


def _children_by_parent() -> dict[int, list[int]]:
    """pid -> child pids, from Linux's /proc (empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # the name in (...) may hold spaces
            children.setdefault(ppid, []).append(int(stat.parent.name))
    return children


def kill_started_processes() -> None:
    """SIGKILL every process this one started, and theirs (a local Ray cluster: GCS, raylet, its agents and
    workers, TransferQueue's actors). Each is stopped (SIGSTOP) first, parents before children, so that none
    starts another while the tree is walked. Linux only (elsewhere Ray's fate sharing is what remains)."""
    frozen: list[int] = []
    todo = [os.getpid()]
    while todo:
        tree = _children_by_parent()
        todo = [c for p in todo for c in tree.get(p, []) if c not in frozen]
        for pid in todo:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGSTOP)
                frozen.append(pid)
    for pid in frozen:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def stop_after_api_death(command: str, api: Any, returncode: int) -> None:
    """The embedded Prefect API exited mid-run (killed, crashed): stop the run now, with one line that says
    what died and how to resume, and exit `EXIT_API_DIED`.

    Why stop rather than train on: every state change, artifact and result of the flow and its tasks is a call
    to that API, which Prefect's client retries for about a minute per call before it fails, so the run would
    crawl and then fail somewhere less clear, with nowhere to report its outcome. Why `os._exit`: a normal
    unwind would make those calls first (the flows' crash states). Nothing is lost: checkpoints are written to a
    temporary folder and renamed into place, so the last complete one is what the next run resumes from (a
    half-written one is removed when it starts). The processes this run started (a local Ray cluster with its
    TransferQueue and actors) are killed first (`kill_started_processes`; Ray's own fate sharing would leave
    its agents behind); a joined cluster drops this driver's actors when it exits; the checkpoint-folder lock
    is released with the process.
    """
    try:
        died = signal.Signals(-returncode).name if returncode < 0 else None
    except ValueError:
        died = f"signal {-returncode}"
    how = f"was killed by {died}" if died else f"exited with code {returncode}"
    try:  # whatever happens to the message (a closed stderr), the run still stops
        print(
            f"{command}: the run's Prefect API server (pid {api.proc.pid}, {api.url}) {how} mid-run (its log: "
            f"{os.environ.get('PREFECT_HOME')}/server.log); the run is stopped and its last checkpoint is intact: "
            "run the same command again to resume from it",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
    finally:
        kill_started_processes()
        os._exit(EXIT_API_DIED)


def run_flow_from_cli(command: str, flow_path: str, parameters: Mapping[str, Any], report: Callable[[Any], None]) -> int:
    """Steps 1-5 for the flow at `flow_path` called with `parameters`; `report` prints its result."""
    prepare_process()
    flows: list[Any] = []
    with (
        prefect_api(command, warm_up=lambda: flows.append(load_flow(flow_path))) as api,
        api.watch(lambda returncode: stop_after_api_death(command, api, returncode)),
    ):
        if api.ui_url:
            print(f"{command}: watch the run at {api.ui_url}/runs", flush=True)
        from prefect.exceptions import TerminationSignal

        try:
            state = flows[0](**parameters, return_state=True)
        except (KeyboardInterrupt, SystemExit, TerminationSignal):
            # Ctrl-C, or SIGTERM (which Prefect's engine turns into a crash + SystemExit): the flow's
            # finally has closed the TransferQueue and the actors; Ray and the server stop below.
            print(f"{command}: {_INTERRUPTED}", file=sys.stderr)
            return 130
        finally:
            shutdown_ray()
        closing = _closing_line(command, api, state.state_details.flow_run_id)
        if not state.is_completed() and _was_stopped(state):
            print(f"{command}: {_INTERRUPTED}", file=sys.stderr)
            return 130
        if not state.is_completed():
            print(f"{command}: run {state.name}: {state.message}", file=sys.stderr)
            if closing:
                print(closing, flush=True)
            return 1
        report(state.result())
        if closing:
            print(closing, flush=True)
    return 0


def _closing_line(command: str, api: Any, flow_run_id: Any) -> str | None:
    """Where to browse the finished run: the link on a server of the user's own (it stays up); for the embedded API,
    which stops with this process, the command that serves its database again and the link then."""
    if not api.ui_url:
        return None
    if api.server is None:
        return f"{command}: the run in the Prefect UI: {api.ui_url}/runs/flow-run/{flow_run_id}"
    return (
        f"{command}: browse the run (the Prefect API of this run has stopped): PREFECT_HOME={os.environ.get('PREFECT_HOME')} "
        f"prefect server start, then open http://127.0.0.1:4200/runs/flow-run/{flow_run_id}"
    )
