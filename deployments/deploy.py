"""Register OmniFlow's deployments on work pools: `omniflow deploy [NAME ...] [--pool POOL]`.

The deployments are those of `deployments/definitions.py` (the ones `omniflow serve` serves), registered with
Prefect's own `prefect.deploy` (the Python form of `prefect deploy`):
- with no names, the local deployments, on the process pool `omniflow-process` (or `--pool`); their runs start
  in the folder `omniflow deploy` ran from (a `set_working_directory` pull step), so relative paths such as
  models/tiny-sd3 resolve there, as with `make run`;
- a named container deployment goes on its own pool (`omniflow-docker`, `omniflow-kubernetes`, or `--pool`),
  with its job variables; its runs start in the image's work folder.

The work pools must exist first (`prefect work-pool create NAME --type process|docker|kubernetes`); then a
worker of each pool runs what is triggered: `prefect worker start --pool NAME`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from omniflow.deployments.serve import WEBHOOK_ENV, ensure_automations_if_present

if TYPE_CHECKING:
    from prefect.deployments.runner import RunnerDeployment

# How to create each pool of definitions.py, for the error that names a missing one.
POOL_CREATE = {
    "omniflow-process": "prefect work-pool create omniflow-process --type process",
    "omniflow-docker": "prefect work-pool create omniflow-docker --type docker  (pip install 'omniflow-rl[docker]')",
    "omniflow-kubernetes": (
        "prefect work-pool create omniflow-kubernetes --type kubernetes "
        "--base-job-template examples/cluster/k8s-gpu-base-job-template.json  (pip install 'omniflow-rl[kubernetes]')"
    ),
}


def chosen_deployments(
    names: Sequence[str] | None, pool: str | None = None, workdir: str | Path | None = None, **images: str
) -> dict[str, list[RunnerDeployment]]:
    """The deployments to register, by work pool: the local ones (or those named), each on `pool`, else on its
    own pool, else on the process pool; the local ones start their runs in `workdir` (default: this folder)."""
    from omniflow.deployments.definitions import PROCESS_POOL, container_deployments, local_deployments, select
    from prefect.runner.storage import LocalStorage

    local = local_deployments()
    chosen = select([*local, *container_deployments(**images)], list(names)) if names else local
    by_pool: dict[str, list[RunnerDeployment]] = {}
    for deployment in chosen:
        if deployment.work_pool_name is None:  # a local deployment: run where the deploy ran
            deployment.storage = LocalStorage(str(Path(workdir or Path.cwd()).resolve()))
        by_pool.setdefault(pool or deployment.work_pool_name or PROCESS_POOL, []).append(deployment)
    return by_pool


def deploy_deployments(by_pool: dict[str, list[RunnerDeployment]]) -> list[str]:
    """Register each pool's deployments with `prefect.deploy` (no image build: the code is installed where the
    runs start); the registered `flow/deployment` names."""
    from prefect import deploy
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        for pool in by_pool:
            try:
                client.read_work_pool(pool)
            except ObjectNotFound:
                create = POOL_CREATE.get(pool, f"prefect work-pool create {pool} --type <process|docker|kubernetes>")
                raise ValueError(f"work pool {pool!r} does not exist; create it first: {create}") from None
    registered = []
    for pool, deployments in by_pool.items():
        deploy(*deployments, work_pool_name=pool, build=False, push=False, print_next_steps_message=False, ignore_warnings=True)
        registered += [f"{d.flow_name}/{d.name} -> {pool}" for d in deployments]
    return registered


def build_parser() -> argparse.ArgumentParser:
    from omniflow.deployments.definitions import DOCKER_IMAGE, KUBERNETES_IMAGE

    parser = argparse.ArgumentParser(prog="omniflow deploy", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "names", nargs="*", help="deployments to register (default: the local ones of deployments/definitions.py)"
    )
    parser.add_argument("--pool", default=None, help="the work pool (default: each deployment's own; omniflow-process)")
    parser.add_argument("--docker-image", default=DOCKER_IMAGE, help=f"image of the docker deployment (default {DOCKER_IMAGE})")
    parser.add_argument(
        "--kubernetes-image", default=KUBERNETES_IMAGE, help=f"image of the Kubernetes deployment (default {KUBERNETES_IMAGE})"
    )
    parser.add_argument(
        "--alert-webhook",
        default=os.environ.get(WEBHOOK_ENV),
        metavar="URL",
        help=f"the webhook OmniFlow's automations notify (default: ${WEBHOOK_ENV}; none and no saved omniflow-alerts block: no automations)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    from omniflow.deployments.definitions import DeploymentChoiceError
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():  # Prefect would register them in a temporary server of this process
        print("omniflow deploy: set PREFECT_API_URL to the Prefect server that the workers poll", file=sys.stderr)
        return 2
    try:
        by_pool = chosen_deployments(ns.names, ns.pool, docker_image=ns.docker_image, kubernetes_image=ns.kubernetes_image)
        for line in deploy_deployments(by_pool):
            print(f"omniflow deploy: {line}", flush=True)
    except (DeploymentChoiceError, ValueError) as exc:
        print(f"omniflow deploy: {exc}", file=sys.stderr)
        return 2
    ensure_automations_if_present("omniflow deploy", ns.alert_webhook)
    for pool in by_pool:
        print(f"omniflow deploy: runs start when a worker polls the pool: prefect worker start --pool {pool}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
