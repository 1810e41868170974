"""Stage 7 — `fit_epoch`: one epoch of verl-omni's `trainer.fit()`, run on a Ray worker and retried.

A function of (config, epoch, last checkpoint): it rebuilds the controller, finds the run's actors by
name, restarts from the last checkpoint written before a failure (the actor reloads it if its
weights moved past it; stale TransferQueue rows are cleared), trains the epoch (the flow holds the run's GPU
slots, `gpu_slots`), saves its checkpoint, and publishes
the epoch's metrics table and checkpoint card as artifacts. A stop of the run (`omni_core.distributed.run_control`) ends it
Cancelled, never retried. The trainer's log lines go to the run's log as they happen: its own (`log_callback`), those of `omni_core` loggers in this
process (a `CallbackHandler` for the task's duration), and the actors' (training ranks, rollout workers),
which the trainer drains after every step (`omni_core.distributed.worker_logs`).
"""

from __future__ import annotations

from omniflow.tasks.publish_reports import publish_card, publish_validation_grids
from omniflow.tasks.retry_policy import retry_infrastructure_failures
from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import Cancelled, State

from omni_core.config import OmniFlowConfig
from omni_core.data.prompts import PromptRecord
from omni_core.distributed.run_control import RunStopRequested
from omni_core.distributed.worker_logs import omni_core_logs_to
from omni_core.records import EpochResult, RunInfo
from omni_core.reports.cards import checkpoint_card, epoch_metrics_rows
from omni_core.trainers import build_diffusion_trainer


@task(
    name="fit_epoch",
    task_run_name="fit_epoch-{epoch}",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=retry_infrastructure_failures,
)
def fit_epoch(
    config: OmniFlowConfig,
    run: RunInfo,
    epoch: int,
    train_records: list[PromptRecord],
    val_records: list[PromptRecord],
    resume_from: str | None,
    progress_artifact_id: str | None = None,
) -> EpochResult | State:
    log = get_run_logger().log
    with omni_core_logs_to(log):
        trainer = build_diffusion_trainer(config, run)
        trainer.restore_context(train_records, val_records, resume_from)
        trainer.log_callback = log
        if progress_artifact_id:
            trainer.step_callback = lambda step, total, _: update_progress_artifact(
                progress_artifact_id, progress=100.0 * step / total
            )
        try:
            result = trainer.fit_epoch(epoch)
        except RunStopRequested as stop:  # Ctrl-C, SIGTERM or a UI cancel of the run: not a failure to retry
            return Cancelled(message=str(stop))
    _publish(result)
    return result


def _publish(result: EpochResult) -> None:
    publish_validation_grids(result)
    create_table_artifact(
        key="omniflow-epoch-metrics",
        table=epoch_metrics_rows(result),
        description=f"Metrics of epoch {result.epoch}, one row per step",
    )
    card = checkpoint_card(result)
    if card is not None:
        publish_card("omniflow-checkpoint", card)
