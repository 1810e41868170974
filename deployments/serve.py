"""Serve OmniFlow's deployments from one process, for users without a work pool or workers.

`python -m omniflow.deployments.serve` (also `omniflow serve`) serves the local deployments of
`deployments/definitions.py` -- the same objects, parameters, descriptions, tags and schedules that
`omniflow deploy` registers on a process work pool -- with `prefect.serve`: the process polls the Prefect API
for its deployments' runs (scheduled, or triggered from the UI / `run_deployment`) and runs each one in a
subprocess.

Stopping it (Ctrl-C, SIGTERM) leaves the deployments and their schedules active (`pause_on_shutdown`
is off): the next `serve` picks the schedule up again, and the UI never shows a nightly paused by a
restart. Without `PREFECT_API_URL` it starts the embedded local Prefect API first (as `omniflow train`
does) and keeps it for as long as it serves.

Served runs import reward files only from OmniFlow's `examples/rewards` and the folders named by
`--allow-reward-dir` / `OMNIFLOW_ALLOWED_REWARD_DIRS` (a reward file is code; see docs/security.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

# WEBHOOK_ENV: the variable naming the webhook that OmniFlow's automations notify (automations.py owns it).
from omniflow.deployments.automations import WEBHOOK_ENV

if TYPE_CHECKING:
    from prefect.deployments.runner import RunnerDeployment


def served_deployments(names: Sequence[str] | None = None) -> list[RunnerDeployment]:
    """The local deployments of definitions.py, all of them or those named; a container deployment is refused
    (it runs where a worker of its docker / kubernetes pool runs: `omniflow deploy NAME`)."""
    from omniflow.deployments.definitions import DeploymentChoiceError, container_deployments, local_deployments, select

    local = local_deployments()
    containers = {d.name: d.work_pool_name for d in container_deployments()}
    named = [n for n in names or [] if n in containers]
    if named:
        raise DeploymentChoiceError(
            f"{named} run in containers of a work pool ({', '.join(containers[n] for n in named)}), not in this process: "
            f"register them with `omniflow deploy {' '.join(named)}` and start a worker of that pool"
        )
    return select(local, list(names or []))


def ensure_automations_if_present(
    command: str, webhook_url: str | None, register: Callable[[], object] | None = None
) -> list[str]:
    """Create OmniFlow's automations (deployments/automations.py) after `register` (which registers the deployments
    they name); their names, printed. Without a webhook (`--alert-webhook`, ${WEBHOOK_ENV}) or a notification block
    saved as `omniflow-alerts`, none is created, and one line says how to add them."""
    from omniflow.deployments.automations import ensure_automations

    if register is not None:
        register()
    names = ensure_automations(webhook_url=webhook_url)
    if names:
        print(f"{command}: automations: {', '.join(names)}", flush=True)
    else:
        print(
            f"{command}: no alerts: set --alert-webhook URL (or {WEBHOOK_ENV}), or save a notification block named "
            "omniflow-alerts, for the failed-run and reward-regression automations",
            flush=True,
        )
    return names


def serve_deployments(deployments: Sequence[RunnerDeployment], limit: int | None = None, webhook_url: str | None = None) -> None:
    """Serve `deployments` until stopped; their schedules stay active afterwards. They are registered first, so
    that the automations can name them."""
    from prefect import serve

    ensure_automations_if_present("omniflow serve", webhook_url, register=lambda: [d.apply() for d in deployments])
    serve(*deployments, pause_on_shutdown=False, limit=limit, print_starting_message=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omniflow serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="deployments to serve (default: all local ones of deployments/definitions.py)")
    parser.add_argument("--limit", type=int, default=None, help="most flow runs at once (default: no limit)")
    parser.add_argument(
        "--alert-webhook",
        default=os.environ.get(WEBHOOK_ENV),
        metavar="URL",
        help=f"the webhook OmniFlow's automations notify (default: ${WEBHOOK_ENV}; none: automations without notifications)",
    )
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
    from omniflow.deployments.definitions import DeploymentChoiceError
    from omniflow.flows.runner import prefect_api, prepare_process

    allow_reward_dirs(ns.allow_reward_dir)
    prepare_process()

    deployments: list[RunnerDeployment] = []
    try:
        # The flows are imported while an embedded server boots; a bad name fails before anything is served.
        with prefect_api("omniflow serve", warm_up=lambda: deployments.extend(served_deployments(ns.names))) as api:
            print(f"omniflow serve: deployments: {', '.join(d.name for d in deployments)}", flush=True)
            if api.ui_url:
                print(f"omniflow serve: open {api.ui_url}/deployments to trigger a run with parameters", flush=True)
            serve_deployments(deployments, ns.limit, ns.alert_webhook)
    except DeploymentChoiceError as exc:
        print(f"omniflow serve: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("omniflow serve: stopped; the deployments and their schedules stay active", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
