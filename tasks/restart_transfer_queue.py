"""`restart_transfer_queue`: a new TransferQueue after its controller or a storage unit died (issue 11).

Runs in the flow's process, which started the first one and so owns (and closes) the new one too; the
`fit` subflow calls it before it redoes the epoch that lost the queue from that epoch's last checkpoint.
"""

from __future__ import annotations

from prefect import get_run_logger, task

from omni_core.config import OmniFlowConfig
from omni_core.tq.client import restart_transfer_queue as restart


@task(name="restart_transfer_queue")
def restart_transfer_queue(config: OmniFlowConfig) -> list[str]:
    """Returns the TransferQueue actors that had died ([] when another run had restarted it already)."""
    dead = restart(config.transfer_queue)
    get_run_logger().warning(
        f"TransferQueue restarted ({', '.join(dead)} had died; the rows it held are gone)"
        if dead
        else "TransferQueue was already running again"
    )
    return dead
