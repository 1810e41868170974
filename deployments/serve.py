"""Serve OmniFlow's deployments from one process, for users without a work pool or workers.

`python -m omniflow.deployments.serve` (also `omniflow serve`) reads `deployments/prefect.yaml` -- the
same deployments, parameters, descriptions, tags and schedules that `prefect deploy --all` registers --
and serves them with `prefect.serve`: the process polls the Prefect API for its deployments' runs
(scheduled, or triggered from the UI / `run_deployment`) and runs each one in a subprocess.

Stopping it (Ctrl-C, SIGTERM) leaves the deployments and their schedules active (`pause_on_shutdown`
is off): the next `serve` picks the schedule up again, and the UI never shows a nightly paused by a
restart. Without `PREFECT_API_URL` it starts the embedded local Prefect API first (as `omniflow train`
does) and keeps it for as long as it serves.

Served runs import reward files only from OmniFlow's `examples/rewards` and the folders named by
`--allow-reward-dir` / `OMNIFLOW_ALLOWED_REWARD_DIRS` (a reward file is code; see README "Security").
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

DEPLOYMENTS_FILE = Path(__file__).with_name("prefect.yaml")
# Keys a deployment in prefect.yaml may have; serve uses all but work_pool and pull (they concern workers).
_KNOWN_KEYS = {"name", "entrypoint", "description", "tags", "version", "schedules", "parameters", "work_pool", "pull"}


def load_deployment_specs(path: str | Path = DEPLOYMENTS_FILE, names: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The `deployments:` entries of a prefect.yaml, all of them or those named in `names`."""
    specs = yaml.safe_load(Path(path).read_text()).get("deployments") or []
    for spec in specs:
        unknown = set(spec) - _KNOWN_KEYS
        if unknown:
            raise ValueError(f"{path}: deployment {spec.get('name')!r} has keys serve does not support: {sorted(unknown)}")
    if names:
        known = [s["name"] for s in specs]
        missing = [n for n in names if n not in known]
        if missing:
            raise ValueError(f"no deployment named {missing} in {path}; choose from {known}")
        specs = [s for s in specs if s["name"] in names]
    return specs


def _schedules(spec: dict[str, Any]) -> list[Any]:
    from prefect.schedules import Cron, Interval

    out = []
    for s in spec.get("schedules") or []:
        if "cron" in s:
            out.append(Cron(s["cron"], timezone=s.get("timezone"), active=s.get("active", True)))
        elif "interval" in s:
            out.append(Interval(s["interval"], timezone=s.get("timezone"), active=s.get("active", True)))
        else:
            raise ValueError(f"deployment {spec['name']!r}: only cron and interval schedules are served, got {s}")
    return out


def build_deployments(specs: Sequence[dict[str, Any]]) -> list[Any]:
    """One `RunnerDeployment` per spec, from the flow its entrypoint names."""
    from prefect.flows import load_flow_from_entrypoint

    deployments = []
    for spec in specs:
        flow = load_flow_from_entrypoint(spec["entrypoint"])
        deployments.append(
            flow.to_deployment(
                name=spec["name"],
                description=spec.get("description"),
                tags=spec.get("tags"),
                version=spec.get("version"),
                parameters=spec.get("parameters") or {},
                schedules=_schedules(spec),
            )
        )
    return deployments


def serve_deployments(specs: Sequence[dict[str, Any]], limit: int | None = None) -> None:
    """Serve `specs` (from `load_deployment_specs`) until stopped; their schedules stay active afterwards."""
    from prefect import serve

    deployments = build_deployments(specs)
    serve(*deployments, pause_on_shutdown=False, limit=limit, print_starting_message=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omniflow serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="deployments to serve (default: all in the file)")
    parser.add_argument("--file", default=str(DEPLOYMENTS_FILE), help="a prefect.yaml (default: OmniFlow's own)")
    parser.add_argument("--limit", type=int, default=None, help="most flow runs at once (default: no limit)")
    parser.add_argument(
        "--allow-reward-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder whose reward files the served runs may import (repeatable; added to OMNIFLOW_ALLOWED_REWARD_DIRS; "
        "by default only OmniFlow's examples/rewards): reward files run code, and anyone who can reach the Prefect "
        "API can trigger a run",
    )
    return parser


def allow_reward_dirs(dirs: Sequence[str]) -> None:
    """Add `dirs` (absolute) to this process's OMNIFLOW_ALLOWED_REWARD_DIRS, which every served run inherits."""
    from omni_core.validation.rewards import ALLOWED_REWARD_DIRS_ENV

    current = [d for d in os.environ.get(ALLOWED_REWARD_DIRS_ENV, "").split(os.pathsep) if d]
    os.environ[ALLOWED_REWARD_DIRS_ENV] = os.pathsep.join([*current, *(str(Path(d).expanduser().resolve()) for d in dirs)])


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        specs = load_deployment_specs(ns.file, ns.names)  # a bad name or file fails before any server starts
    except (OSError, ValueError) as exc:
        print(f"omniflow serve: {exc}", file=sys.stderr)
        return 2
    from omniflow.flows.runner import prefect_api, prepare_process

    allow_reward_dirs(ns.allow_reward_dir)
    prepare_process()
    with prefect_api("omniflow serve") as api:
        print(f"omniflow serve: deployments: {', '.join(s['name'] for s in specs)}", flush=True)
        if api.ui_url:
            print(f"omniflow serve: open {api.ui_url}/deployments to trigger a run with parameters", flush=True)
        try:
            serve_deployments(specs, ns.limit)
        except KeyboardInterrupt:
            print("omniflow serve: stopped; the deployments and their schedules stay active", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
