"""The retry policy of the retried tasks (`init_transfer_queue`, `init_trainer`, `init_agent_loop`,
`fit_epoch`): Prefect retries only infrastructure failures (`omni_core.faults.is_retryable`: a dead actor,
worker or node, a timeout, a lost object), never a config error, a reward that raises or an out-of-memory
error, which the same settings would only repeat. A dead TransferQueue is not retried here either: the
`fit` subflow restarts it first (`restart_transfer_queue`), then redoes the epoch."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger

from omni_core.faults import is_retryable, is_transfer_queue_lost


def retry_infrastructure_failures(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect `retry_condition_fn`: True when the failed state's exception is worth a retry."""
    exc = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    if not isinstance(exc, BaseException):
        return False
    retry = is_retryable(exc)
    if is_transfer_queue_lost(exc):
        get_run_logger().info(f"{task_run.name}: not retried here (the TransferQueue is lost; the flow starts a new one)")
    elif not retry:
        get_run_logger().info(f"{task_run.name}: not retried ({type(exc).__name__} is not an infrastructure failure)")
    return retry
