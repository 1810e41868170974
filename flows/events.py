"""OmniFlow's Prefect events: their names, what they concern, the reward-regression rule, and their emission.

Events (Prefect's event feed, and the triggers of automations such as `deployments/automations.py`'s):

| event | when | payload |
|---|---|---|
| `omniflow.checkpoint.saved` | each checkpoint an epoch wrote | step, epoch, path |
| `omniflow.validation.completed` | each validation | step, epoch, reward (mean of the `val-core/*` rewards), metrics, grid |
| `omniflow.reward.regressed` | a validation reward more than `trainer.alerts.reward_regression_drop` below the run's best | step, reward, best, best_step, drop |
| `omniflow.run.failed` | `main_diffusion_v1` failed or crashed (its `on_failure` / `on_crashed` hook) | state, message, flow |

The first three concern the experiment (`omniflow.experiment.<project>.<experiment>`) and name the run's
`main_diffusion_v1` flow run and the checkpoint as related resources. They are emitted by the `fit` subflow in
the flow process when an epoch's result arrives (so at the end of each epoch), which also keeps the run's best
validation reward across epochs (each epoch is its own task). omni_core knows nothing of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefect.events import emit_event

from omni_core.checkpoint import complete_steps
from omni_core.config import OmniFlowConfig
from omni_core.records import EpochResult, RunInfo
from omni_core.reports.cards import validation_reward

CHECKPOINT_SAVED = "omniflow.checkpoint.saved"
VALIDATION_COMPLETED = "omniflow.validation.completed"
REWARD_REGRESSED = "omniflow.reward.regressed"
RUN_FAILED = "omniflow.run.failed"


@dataclass(frozen=True)
class Regression:
    step: int
    reward: float
    best: float
    best_step: int
    drop: float


@dataclass
class RewardWatch:
    """The regression rule over a run's validation rewards, in step order.

    A validation whose reward is more than `drop` below the best one so far (`reward < best - drop`) is a
    regression; it is reported once, and again only after a new best (so a run that stays down alerts once,
    not at every validation). `drop=None` reports nothing; the best is kept either way.
    """

    drop: float | None
    best: float | None = None
    best_step: int | None = None
    _reported: bool = False

    def observe(self, step: int, reward: float) -> Regression | None:
        if self.best is None or reward > self.best:
            self.best, self.best_step, self._reported = reward, step, False
            return None
        if self.drop is None or self._reported or not reward < self.best - self.drop:
            return None
        self._reported = True
        assert self.best_step is not None
        return Regression(step, reward, self.best, self.best_step, self.drop)


def experiment_resource(config: OmniFlowConfig, run: RunInfo) -> dict[str, str]:
    t = config.trainer
    return {
        "prefect.resource.id": f"omniflow.experiment.{t.project_name}.{t.experiment_name}",
        "prefect.resource.name": t.experiment_name,
        "omniflow.run-id": run.run_id,
        "omniflow.checkpoint-dir": run.checkpoint_dir,
    }


def _related(flow_run_id: str | None, checkpoint: str | None = None) -> list[dict[str, str]]:
    related = []
    if flow_run_id:  # first: automations' templates take `flow_run` from the first flow-run resource
        related.append({"prefect.resource.id": f"prefect.flow-run.{flow_run_id}", "prefect.resource.role": "flow-run"})
    if checkpoint:
        related.append(
            {
                "prefect.resource.id": f"omniflow.checkpoint.{checkpoint}",
                "prefect.resource.role": "checkpoint",
                "prefect.resource.name": checkpoint.rsplit("/", 1)[-1],
            }
        )
    return related


def _checkpoints(run: RunInfo, result: EpochResult) -> list[tuple[int, str]]:
    """The epoch's checkpoints: `save_freq` ones within it (still on disk) and the one at its end."""
    first = result.global_step - len(result.step_metrics)
    found = {step: str(path) for step, path in complete_steps(run.checkpoint_dir).items() if first < step <= result.global_step}
    if result.checkpoint:
        found[result.global_step] = result.checkpoint
    return sorted(found.items())


def emit_epoch_events(
    config: OmniFlowConfig, run: RunInfo, result: EpochResult, watch: RewardWatch, flow_run_id: str | None
) -> list[str]:
    """Emit the epoch's checkpoint, validation and regression events in step order; returns their names."""
    resource = experiment_resource(config, run)
    timeline: list[tuple[int, int, str, dict[str, Any], str | None]] = []
    for step, path in _checkpoints(run, result):
        timeline.append((step, 1, CHECKPOINT_SAVED, {"step": step, "epoch": result.epoch, "path": path}, path))
    for step, grid, metrics in result.val_grids:
        reward = validation_reward(metrics)
        payload = {"step": step, "epoch": result.epoch, "reward": reward, "metrics": metrics, "grid": grid}
        timeline.append((step, 0, VALIDATION_COMPLETED, payload, None))
    emitted = []
    for step, _, name, payload, checkpoint in sorted(timeline, key=lambda e: e[:2]):
        emit_event(name, resource=resource, related=_related(flow_run_id, checkpoint), payload=payload)
        emitted.append(name)
        regression = (
            watch.observe(step, payload["reward"]) if name == VALIDATION_COMPLETED and payload["reward"] is not None else None
        )
        if regression is not None:
            emit_event(
                REWARD_REGRESSED,
                resource=resource,
                related=_related(flow_run_id),
                payload={
                    "step": regression.step,
                    "reward": regression.reward,
                    "best": regression.best,
                    "best_step": regression.best_step,
                    "drop": regression.drop,
                    "key": "trainer.alerts.reward_regression_drop",
                },
            )
            emitted.append(REWARD_REGRESSED)
    return emitted


def emit_run_failed(flow: Any, flow_run: Any, state: Any) -> None:
    """`on_failure` / `on_crashed` hook of `main_diffusion_v1`: `omniflow.run.failed` naming the run and why."""
    emit_event(
        RUN_FAILED,
        resource={"prefect.resource.id": f"omniflow.flow-run.{flow_run.id}", "prefect.resource.name": flow_run.name},
        related=[
            {
                "prefect.resource.id": f"prefect.flow-run.{flow_run.id}",
                "prefect.resource.role": "flow-run",
                "prefect.resource.name": flow_run.name,
            }
        ],
        payload={"flow": flow.name, "state": state.name, "message": state.message or ""},
    )
