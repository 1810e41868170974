"""Stage 5 — `init_trainer`: verl-omni's `trainer.init()` -> `_setup()` (dataloader, the training actor
on Ray, checkpoint resume). The flow holds the checkpoint folder's run lock around
this and every later stage, so a second run pointed at the same folder is refused before it gets here."""

from __future__ import annotations

from omniflow.tasks.retry_policy import retry_infrastructure_failures
from prefect import task
from prefect.cache_policies import NO_CACHE

from omni_core.data.prompts import PromptRecord
from omni_core.trainers.base import PolicyGradientDiffusionTrainerV1


@task(
    name="init_trainer", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2, retry_condition_fn=retry_infrastructure_failures
)
def init_trainer(
    trainer: PolicyGradientDiffusionTrainerV1, train_records: list[PromptRecord], val_records: list[PromptRecord]
) -> PolicyGradientDiffusionTrainerV1:
    trainer.init(train_records, val_records)
    return trainer
