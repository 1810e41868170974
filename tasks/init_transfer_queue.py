"""Stage 2b — `init_transfer_queue`: verl-omni's `tq.init(config.transfer_queue)` in the Ray driver, on the
cluster `init_ray` connected.

The flow submits it without waiting: the controller and storage-unit processes start while the tokenizer,
the dataset and the actors load, and the flow waits for it before the first epoch. Before starting, the
free logical CPUs are checked against what TransferQueue reserves (a too-small cluster fails with the fix
instead of hanging); a running controller of this cluster is joined instead.
"""

from __future__ import annotations

from omniflow.tasks.retry_policy import retry_infrastructure_failures
from prefect import task

from omni_core.config import OmniFlowConfig
from omni_core.tq.client import close_transfer_queue
from omni_core.tq.client import init_transfer_queue as start_transfer_queue


@task(name="init_transfer_queue", retries=2, retry_delay_seconds=2, retry_condition_fn=retry_infrastructure_failures)
def init_transfer_queue(config: OmniFlowConfig) -> bool:
    """Returns True when this run started the TransferQueue (False: it joined the cluster's running one)."""
    try:
        return start_transfer_queue(config.transfer_queue)
    except BaseException:
        close_transfer_queue()  # what a failed start left (a controller without storage units): a retry starts clean
        raise
