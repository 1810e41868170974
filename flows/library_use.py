"""Calling OmniFlow's flows from Python (library use) with no Prefect API configured.

Prefect's ephemeral mode (no `PREFECT_API_URL`: a temporary server in each process that needs an API) would start
one in the caller and another in every Ray worker of the run (docs/design.md section 7). So OmniFlow's entry flows
(`main_diffusion_v1`, `diffusion_rl_pipeline`) are `EmbeddedApiFlow`s: a top-level call from plain Python with no
API configured first starts the embedded local API (`embedded_api.py`, as `omniflow train` does), points this
process and the run's Ray workers at it (with ephemeral mode off, so nothing can fall back to it), and stops it
when the call returns; if it cannot start, the call fails with what to do instead. Calls inside a flow run
(subflows), served and deployed runs, and processes with `PREFECT_API_URL` set run unchanged.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from prefect import Flow
from prefect.context import FlowRunContext, TaskRunContext

# Read by Prefect's client: false makes a missing API an error instead of a temporary server.
EPHEMERAL_ENV = "PREFECT_SERVER_EPHEMERAL_ENABLED"


def needs_embedded_api() -> bool:
    """True for a top-level flow call in a process with no Prefect API configured (Prefect would go ephemeral)."""
    from prefect.settings import PREFECT_API_URL

    return FlowRunContext.get() is None and TaskRunContext.get() is None and not PREFECT_API_URL.value()


@contextlib.contextmanager
def library_prefect_api(who: str) -> Iterator[str]:
    """Within: the embedded local Prefect API (this process's settings, its environment and so the Ray workers
    started within point at it, ephemeral mode off); stopped afterwards and the environment restored. Yields its URL."""
    from omniflow.flows.embedded_api import embedded_prefect_api
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, PREFECT_SERVER_EPHEMERAL_ENABLED, temporary_settings

    saved = {k: os.environ.get(k) for k in ("PREFECT_API_URL", "PREFECT_HOME", EPHEMERAL_ENV)}
    os.environ[EPHEMERAL_ENV] = "false"
    try:
        with embedded_prefect_api() as api:
            try:
                api.wait_ready()
            except (RuntimeError, TimeoutError) as exc:
                raise RuntimeError(
                    f"{who}: no Prefect API is configured (PREFECT_API_URL) and the embedded local one could not start "
                    f"({exc}; its log: {os.environ.get('PREFECT_HOME')}/server.log). Set PREFECT_API_URL to a running "
                    "Prefect server (`prefect server start`), or run it as `omniflow train`"
                ) from exc
            print(
                f"{who}: no PREFECT_API_URL set: started the embedded Prefect API {api.url} for this call "
                f"(PREFECT_HOME={os.environ['PREFECT_HOME']}; UI {api.ui_url})",
                file=sys.stderr,
                flush=True,
            )
            updates = {
                PREFECT_API_URL: api.url,
                PREFECT_HOME: os.environ["PREFECT_HOME"],
                PREFECT_SERVER_EPHEMERAL_ENABLED: False,
            }
            with temporary_settings(updates=updates):
                yield api.url
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _stop_ray_started_within(call: Callable[[], Any]) -> Any:
    """`call()`; a Ray cluster it left connected that was not connected before (an interrupted run) is stopped."""
    import ray

    before = ray.is_initialized()
    try:
        return call()
    finally:
        if not before and ray.is_initialized():
            ray.shutdown()


class EmbeddedApiFlow(Flow):
    """A Prefect flow whose top-level calls without a Prefect API run against the embedded local API."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not needs_embedded_api():
            return super().__call__(*args, **kwargs)
        with library_prefect_api(self.name):
            return _stop_ray_started_within(lambda: super(EmbeddedApiFlow, self).__call__(*args, **kwargs))


def flow_with_embedded_api(**options: Any) -> Callable[[Callable[..., Any]], EmbeddedApiFlow]:
    """`@flow(**options)`, building an `EmbeddedApiFlow`."""

    def decorate(fn: Callable[..., Any]) -> EmbeddedApiFlow:
        return EmbeddedApiFlow(fn=fn, **options)

    return decorate
