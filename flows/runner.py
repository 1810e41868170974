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
  5. the outcome: exit 0 with the caller's report, 1 with the failed state's message, 130 when stopped.

Light to import: nothing heavy is imported before it is used.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
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


def split_files_and_overrides(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """verl-style argv: YAML files (no '=') first, then key.path=value overrides."""
    files = [a for a in args if "=" not in a]
    overrides = [a for a in args if "=" in a]
    return files, overrides


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


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


def run_flow_from_cli(command: str, flow_path: str, parameters: Mapping[str, Any], report: Callable[[Any], None]) -> int:
    """Steps 1-5 for the flow at `flow_path` called with `parameters`; `report` prints its result."""
    prepare_process()
    flows: list[Any] = []
    with prefect_api(command, warm_up=lambda: flows.append(load_flow(flow_path))) as api:
        if api.ui_url:
            print(f"{command}: watch the run at {api.ui_url}/runs", flush=True)
        from prefect.exceptions import TerminationSignal

        try:
            state = flows[0](**parameters, return_state=True)
        except (KeyboardInterrupt, SystemExit, TerminationSignal):
            # Ctrl-C, or SIGTERM (which Prefect's engine turns into a crash + SystemExit): the flow's
            # finally has closed the TransferQueue and the actors; Ray and the server stop below.
            print(f"{command}: interrupted; the last checkpoint is intact and the run's processes are stopped", file=sys.stderr)
            return 130
        finally:
            shutdown_ray()
        if api.ui_url:
            print(f"{command}: flow run {api.ui_url}/runs/flow-run/{state.state_details.flow_run_id}", flush=True)
        if not state.is_completed():
            print(f"{command}: run {state.name}: {state.message}", file=sys.stderr)
            return 1
        report(state.result())
    return 0
