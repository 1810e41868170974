"""`main_diffusion_v1`: verl-omni's `main_diffusion_v1` entry point as a Prefect flow of DAG tasks.

The stages, in the order of verl-omni's `main()` / `run_diffusion_v1()`:

  1. validate_config      auto_set_device + validate_config + validate_attention_consistency
  2. load_tokenizer, prepare_dataset   (cached across runs); a run whose resume point is already the run's last
                          step (a finished experiment triggered again) ends here, Completed, having started nothing
  3. init_ray             Ray: join `ray_kwargs.ray_init.address` or start a local cluster; the resource check
     init_transfer_queue  tq.init, submitted without waiting: its processes start while stages 4-6 load the
                          embeddings and the actors; the flow waits for it before stage 7
  4. prepare_prompt_embeddings (cached across runs; the text encoders embed every prompt once, so they never stay
                          on a worker's device), and with offline samples prepare_pair_latents (the preference pairs'
                          images through the VAE once, cached too); the run's GPU slots (`trainer.concurrency`, tasks/gpu_slots.py)
                          are taken before it and given back after stage 8; then build_trainer:
                          get_diffusion_trainer_cls(trainer.v1.trainer_mode)(config), with the run record that
                          names the prompt-embeddings file
  5. init_trainer         trainer.init(): dataloader, training actor on Ray, checkpoint resume
  6. init_agent_loop      the rollout workers (none with offline samples: the stage is skipped)
  7. fit                  one `fit_epoch` task per epoch on Ray (prefect-ray), retried; an epoch that lost the
                          TransferQueue (a dead controller or storage unit) is redone from its last
                          checkpoint after `restart_transfer_queue`
  8. close                the TransferQueue and the run's actors, always (also on failure)

`fit` is a subflow with a `RayTaskRunner`: Ray is connected in stage 3 from the config, so the runner
reuses that cluster, also for runs started by a deployment (whose parameters are only known when
the flow starts). CLI: `python -m omniflow.flows.main_diffusion_v1 [CONFIG.yaml] key=value ...`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import sys
import time
from collections.abc import Sequence

from omniflow.flows.cancellation import EpochDeadlinePassed, close_after_cancel_or_crash, stop_signals_held, wait_for_epoch
from omniflow.flows.events import RewardWatch, emit_epoch_events, emit_run_failed
from omniflow.flows.library_use import flow_with_embedded_api
from omniflow.tasks.build_trainer import build_trainer
from omniflow.tasks.close_transfer_queue import close_transfer_queue
from omniflow.tasks.fit_epoch import fit_epoch
from omniflow.tasks.gpu_slots import gpu_slots
from omniflow.tasks.init_agent_loop import init_agent_loop
from omniflow.tasks.init_ray import init_ray
from omniflow.tasks.init_trainer import init_trainer
from omniflow.tasks.init_transfer_queue import init_transfer_queue
from omniflow.tasks.load_tokenizer import load_tokenizer
from omniflow.tasks.prepare_dataset import prepare_dataset
from omniflow.tasks.prepare_pair_latents import prepare_pair_latents
from omniflow.tasks.prepare_prompt_embeddings import prepare_prompt_embeddings
from omniflow.tasks.publish_reports import publish_reward_curve, publish_run_summary
from omniflow.tasks.restart_transfer_queue import restart_transfer_queue
from omniflow.tasks.validate_config import validate_config
from prefect import flow, get_run_logger, runtime
from prefect.artifacts import create_progress_artifact
from prefect.states import Completed
from prefect_ray import RayTaskRunner
from prefect_ray.context import remote_options
from pydantic import BaseModel, Field

from omni_core.checkpoint import RunLock
from omni_core.checkpoint.layout import run_log_dir
from omni_core.config import OmniFlowConfig
from omni_core.data.prompts import PromptRecord
from omni_core.faults import epoch_timeout_error, is_transfer_queue_lost
from omni_core.records import EpochResult, RunInfo
from omni_core.reports.cards import already_complete_note
from omni_core.reports.plots import step_noise
from omni_core.trainers.run_length import finished_step
from omni_core.validation.paths import validate_resume

REWARD_WINDOW = 3  # steps averaged for the "first" and "last" reward of a run
# New TransferQueues per epoch after a controller or storage unit died (each redoes the epoch from its checkpoint).
MAX_TRANSFER_QUEUE_RESTARTS = 2
# The TransferQueue's start (its processes on Ray; ~5-13 s on 2 cores) is bounded like every other wait.
QUEUE_START_TIMEOUT_S = 600


class TrainResult(BaseModel):
    """What the flow returns, so a parent flow can use it."""

    run_id: str = Field(description="Run id (TransferQueue partitions and actor names).")
    final_checkpoint: str | None = Field(description="The last checkpoint folder (global_step_N).")
    global_step: int = Field(description="Steps trained in total.")
    final_metrics: dict[str, float] = Field(description="Metrics of the last step.")
    val_metrics: dict[str, float] = Field(default_factory=dict, description="Metrics of the last validation.")
    val_before_train: dict[str, float] = Field(
        default_factory=dict, description="Metrics of the validation before training (trainer.val_before_train), if any."
    )
    val_step: int | None = Field(default=None, description="The step of the last validation (0: before training).")
    reward_first: float = Field(description=f"Mean critic/rewards/mean of the first {REWARD_WINDOW} steps of this run.")
    reward_last: float = Field(description=f"Mean critic/rewards/mean of the last {REWARD_WINDOW} steps of this run.")
    reward_step_noise: float | None = Field(
        default=None,
        description="Step-to-step noise of critic/rewards/mean (std of consecutive differences / sqrt 2); "
        "None under 3 steps. (reward_last - reward_first) / reward_step_noise says how far learning stands out of it.",
    )
    margin_first: float | None = Field(
        default=None,
        description=f"Diffusion-DPO runs: mean actor/rewards/margins (the implicit reward margin of chosen over rejected) "
        f"of the first {REWARD_WINDOW} steps of this run; None for other losses.",
    )
    margin_last: float | None = Field(default=None, description=f"... of the last {REWARD_WINDOW} steps.")
    offline: bool = Field(
        default=False, description="Trained on a data set's preference pairs (algorithm.sample_source=offline): the rewards are their scores."
    )
    checkpoint_dir: str = Field(description="The run's checkpoint folder.")
    note: str | None = Field(
        default=None, description="What the run says of itself: set when it resumed a finished experiment and trained nothing."
    )
    log_dir: str = Field(description="The run's metrics (metrics.jsonl, TensorBoard) folder.")


def _import_epoch_modules() -> int:
    import omniflow.tasks.fit_epoch  # noqa: F401  (torch, prefect, the trainers)
    import transfer_queue  # noqa: F401

    return os.getpid()


def warm_epoch_worker() -> None:
    """Import the `fit_epoch` task's modules in a Ray worker now, without waiting: Ray keeps that idle worker for
    the run's next task, so the first epoch starts in a process that has them (~4-5 s of imports on 2 cores,
    now done while the TransferQueue and the actors start)."""
    import ray

    ray.remote(num_cpus=1, max_retries=0)(_import_epoch_modules).options(name="warm_epoch_worker").remote()


def run_stamp() -> str:
    """`<scheduled start, UTC, %Y%m%d-%H%M%S>-<flow run name>`: unique per run, sortable, readable."""
    start = runtime.flow_run.scheduled_start_time
    return f"{start.astimezone(datetime.UTC):%Y%m%d-%H%M%S}-{runtime.flow_run.name or 'local'}"


def make_run_info(config: OmniFlowConfig) -> RunInfo:
    """Run identity from the flow run: partitions and actor names of concurrent runs never collide."""
    flow_run_id = str(runtime.flow_run.id or "local")[:8]
    run_id = f"{config.trainer.experiment_name}-{flow_run_id}"
    root = config.trainer.checkpoint_dir.resolve()
    return RunInfo(
        run_id=run_id,
        namespace="omniflow",
        checkpoint_dir=str(root),
        log_dir=str(run_log_dir(root, run_id)),
        started_at=time.time(),
    )


@flow(name="fit", task_runner=RayTaskRunner(), log_prints=True)
def fit(
    config: OmniFlowConfig,
    run: RunInfo,
    train: list[PromptRecord],
    val: list[PromptRecord],
    resume_from: str | None,
    start_epoch: int,
    end_epoch: int,
) -> list[EpochResult]:
    """verl-omni's `trainer.fit()`: one `fit_epoch` task per epoch (`start_epoch .. end_epoch - 1`), each on
    a Ray worker, in order."""
    progress = create_progress_artifact(
        progress=100.0 * start_epoch / end_epoch, key="omniflow-progress", description="Training progress (steps done / total)"
    )
    results = []
    watch = RewardWatch(config.trainer.alerts.reward_regression_drop)  # the run's best validation reward, across epochs
    timeout_s = config.trainer.epoch_timeout_s
    for epoch in range(start_epoch, end_epoch):
        # trainer.epoch_timeout_s bounds the epoch, Prefect's retries and TransferQueue restarts included (null: no bound)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for restarts in range(MAX_TRANSFER_QUEUE_RESTARTS + 1):
            # Ray's own task retries stay off: Prefect's (from the last checkpoint, infrastructure failures only) are the only ones.
            with remote_options(max_retries=0), stop_signals_held():  # a stop lands after the inputs are serialised
                future = fit_epoch.submit(config, run, epoch, train, val, resume_from, str(progress))
            try:
                results.append(wait_for_epoch(future, run.names, deadline))  # a stop ends it at once
                break
            except EpochDeadlinePassed:
                raise epoch_timeout_error(epoch, timeout_s or 0.0) from None
            except Exception as exc:
                if restarts == MAX_TRANSFER_QUEUE_RESTARTS or not is_transfer_queue_lost(exc):
                    raise
                get_run_logger().warning(
                    f"epoch {epoch} lost the TransferQueue; starting a new one and redoing the epoch from its last "
                    f"checkpoint ({restarts + 1}/{MAX_TRANSFER_QUEUE_RESTARTS})"
                )
                restart_transfer_queue(config)
        with stop_signals_held():  # Prefect serialises these tasks' inputs too
            # checkpoint / validation / regression events, naming main_diffusion_v1's run (this subflow's parent)
            emit_epoch_events(config, run, results[-1], watch, runtime.flow_run.parent_flow_run_id or runtime.flow_run.id)
            publish_reward_curve(run, results, end_epoch)
    return results


# The result is persisted as JSON (a TrainResult, never a pickle), so `run_deployment(...).state.result()` reads it
# from another process: see docs/deployments.md, "Results".
# on_failure / on_crashed: the `omniflow.run.failed` event (flows/events.py). on_cancellation / on_crashed: what the run
# left in this process's Ray is stopped (flows/cancellation.py). Called from plain Python with no Prefect API, it
# starts the embedded one, never Prefect's ephemeral mode (flows/library_use.py).
@flow_with_embedded_api(
    name="main_diffusion_v1",
    log_prints=True,
    persist_result=True,
    result_serializer="json",
    on_failure=[emit_run_failed],
    on_crashed=[emit_run_failed, close_after_cancel_or_crash],
    on_cancellation=[close_after_cancel_or_crash],
)
def main_diffusion_v1(
    config: OmniFlowConfig | None = None,
    overrides: list[str] = [],  # noqa: B006  (Prefect parameters are copied per run)
    config_files: list[str] = [],  # noqa: B006
    new_experiment_per_run: bool = False,
) -> TrainResult:
    """Fine-tune a diffusion model with Flow-GRPO (verl-omni's main_diffusion_v1, stage by stage).

    Args:
        config: The whole training config (verl-omni key paths); omitted fields take their defaults.
            Leave empty to start from the defaults, or from `config_files`.
        overrides: verl-style `key.path=value` strings applied on top of the config, e.g.
            `data.train_batch_size=8` or `actor_rollout_ref.rollout.n=8`; Hydra's `+key=value` and
            `~key` too, and `${...}` interpolation.
        config_files: YAML config files read in order when `config` is empty (paths on the machine
            that runs the flow); `${...}` in them is resolved and a `defaults:` list of sibling files is read.
        new_experiment_per_run: Start a new experiment named after this run
            (`<trainer.experiment_name>-<scheduled start>-<flow run name>`) instead of resuming the
            experiment's last checkpoint; scheduled deployments set it.
    """
    cfg = validate_config(config, overrides, config_files, run_stamp() if new_experiment_per_run else None)
    run = make_run_info(cfg)
    with RunLock(run.checkpoint_dir, run.run_id):
        # The resume point (manifest sizes, optimizer saved, same model / LoRA / dtype / world size) is checked
        # once this run holds the folder, before Ray starts; the trainer hashes every byte when it loads it.
        resume_point = validate_resume(cfg)
        tokenizer = load_tokenizer(cfg.actor_rollout_ref.model)
        offline = cfg.algorithm.sample_source == "offline"  # a data set's preference pairs: no rollout workers
        train, val = prepare_dataset(cfg.data, tokenizer, offline)
        # A run of a finished experiment (the on-demand deployment triggered again from the UI resumes its experiment
        # unless new_experiment_per_run is set) starts nothing: its state message and summary say how to start anew.
        done_at = finished_step(cfg, resume_point, len(train))
        if done_at is not None:
            return finished_experiment(cfg, run, resume_point, done_at)
        owns_ray, trainer, queue = False, None, None
        # The run's GPU slots (trainer.concurrency): taken before the first model load, given back after the close.
        gpus = contextlib.ExitStack()
        try:
            owns_ray = init_ray(cfg)
            warm_epoch_worker()
            queue = init_transfer_queue.submit(cfg)
            gpus.enter_context(gpu_slots(cfg, "the run"))
            embeddings = prepare_prompt_embeddings(cfg.actor_rollout_ref, cfg.trainer.device, train, val)
            run = dataclasses.replace(run, prompt_embeddings=embeddings)
            if offline:
                run = dataclasses.replace(run, pair_latents=prepare_pair_latents(cfg.actor_rollout_ref, cfg.trainer.device, train))
            trainer = build_trainer(cfg, run)
            if not owns_ray:
                # A joined (multi-node) cluster: the TransferQueue is placed before the run's actors, as verl-omni
                # orders it; started at once, the actors' placement group could take the CPUs of the node where a
                # storage unit must go, and tq.init would wait forever. A local cluster is one node: no such risk.
                queue.result(timeout=QUEUE_START_TIMEOUT_S)
            trainer = init_trainer(trainer, train, val)
            if not offline:
                init_agent_loop(trainer)
            queue.result(timeout=QUEUE_START_TIMEOUT_S)
            resume_from, start_step = trainer.resume_from, trainer.global_step
            epochs = fit(cfg, run, train, val, resume_from, trainer.start_epoch, trainer.end_epoch)
        finally:
            with gpus:
                if queue is not None:
                    queue.wait(timeout=QUEUE_START_TIMEOUT_S)  # a start still running would race the close
                close_transfer_queue(trainer, owns_ray)
    result = summarize(run, epochs, resume_from, start_step, offline)
    publish_run_summary(run, epochs, result.final_checkpoint, result.global_step)
    return result


def finished_experiment(cfg: OmniFlowConfig, run: RunInfo, checkpoint: str, step: int) -> Completed:
    """The end of a run whose experiment was already complete at `step`: it trained nothing and says so."""
    result = summarize(run, [], checkpoint, step)
    result.note = already_complete_note(cfg.trainer.experiment_name, step)
    publish_run_summary(run, [], result.final_checkpoint, result.global_step, result.note)
    return Completed(message=result.note, data=result)


def _window_means(values: list[float]) -> tuple[float | None, float | None]:
    """The mean of the first and of the last `REWARD_WINDOW` values (None, None: no values)."""
    if not values:
        return None, None
    first, last = values[:REWARD_WINDOW], values[-REWARD_WINDOW:]
    return sum(first) / len(first), sum(last) / len(last)


def summarize(
    run: RunInfo, epochs: list[EpochResult], resume_from: str | None = None, start_step: int = 0, offline: bool = False
) -> TrainResult:
    """The run's typed result (a finished experiment's run gets its note in `finished_experiment`)."""
    steps = [m for e in epochs for m in e.step_metrics]
    rewards = [m["critic/rewards/mean"] for m in steps if "critic/rewards/mean" in m]
    first = rewards[:REWARD_WINDOW]
    last = rewards[-REWARD_WINDOW:]
    margin_first, margin_last = _window_means([m["actor/rewards/margins"] for m in steps if "actor/rewards/margins" in m])
    val = next((e.val_metrics for e in reversed(epochs) if e.val_metrics), {})
    validations = [(step, metrics) for e in epochs for step, _, metrics in e.val_grids]
    if validations:  # every validation of this run, in step order (its grids carry the metrics)
        val_step, val = validations[-1]
    else:
        val_step = 0 if val else None
    before = next((metrics for step, metrics in validations if step == 0), {})
    return TrainResult(
        run_id=run.run_id,
        final_checkpoint=next((e.checkpoint for e in reversed(epochs) if e.checkpoint), resume_from),
        global_step=epochs[-1].global_step if epochs else start_step,
        final_metrics=steps[-1] if steps else {},
        val_metrics=val,
        val_before_train=before,
        val_step=val_step,
        reward_first=sum(first) / len(first) if first else math.nan,
        reward_last=sum(last) / len(last) if last else math.nan,
        reward_step_noise=None if math.isnan(noise := step_noise(rewards)) else noise,
        margin_first=margin_first,
        margin_last=margin_last,
        offline=offline,
        checkpoint_dir=run.checkpoint_dir,
        log_dir=run.log_dir,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m omniflow.flows.main_diffusion_v1 [CONFIG.yaml ...] key=value ...` (as `omniflow train`)."""
    from omniflow.flows.train_cli import run_training

    return run_training(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
