"""The main job as a Prefect flow, in-process: real Ray, real TransferQueue, Prefect's test harness, tiny model.

One reference run is shared: its checkpoints, artifacts and TQ rows are checked, and every other run
(a second run as a subflow, a run with a killed training actor) must end with bit-identical weights.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from flow_utils import assert_same_weights, final_weights

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def flows(prefect_api, ray_cluster, transfer_queue):
    from omniflow.flows import main_diffusion_v1 as module

    return module


@pytest.fixture(scope="module")
def reference(flow_reference):
    return flow_reference


def _read(coro):
    return asyncio.run(coro)


async def _artifacts(flow_run_ids: list) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    async with get_client() as client:
        return await client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=flow_run_ids)))


async def _child_flow_runs(flow_run_id) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    async with get_client() as client:
        return await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
        )


async def _flow_run_tree(flow_run_id) -> list:
    """`flow_run_id` and the ids of all its subflow runs, at any depth."""
    ids, todo = [], [flow_run_id]
    while todo:
        current = todo.pop()
        ids.append(current)
        todo.extend(r.id for r in await _child_flow_runs(current))
    return ids


async def _log_messages(flow_run_ids: list) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async with get_client() as client:
        logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=flow_run_ids)))
    return [log.message for log in logs]


def _wait_for_log_lines(flow_run_id, predicate, timeout_s: float = 60) -> list[str]:
    """The run tree's log messages once `predicate(messages)` holds: a Ray worker sends its task's log lines
    to the API in batches, so they may arrive a moment after the flow run ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        messages = _read(_log_messages(_read(_flow_run_tree(flow_run_id))))
        if predicate(messages) or time.monotonic() > deadline:
            return messages
        time.sleep(1.0)


async def _latest_task_state(name: str) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    async with get_client() as client:
        runs = await client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=name)))
    runs = sorted((r for r in runs if r.start_time), key=lambda r: r.start_time)
    return runs[-1].state.name


def test_two_epochs_write_two_checkpoints_and_their_artifacts(reference):
    state, result, ckpt = reference
    assert result.global_step == 2
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    for step in (1, 2):
        d = ckpt / f"global_step_{step}"
        assert (d / "manifest.json").is_file() and (d / "actor" / "model.safetensors").is_file()
        assert (d / "actor" / "optimizer.pt").is_file() and (d / "dataloader.json").is_file() and (d / "rng.json").is_file()
        assert (d / "actor" / "hf" / "config.json").is_file()  # diffusers-format transformer
    assert Path(result.final_checkpoint).name == "global_step_2"

    # Artifacts: per epoch a metrics table and a checkpoint card, and the progress bar of fit.
    flow_run_id = state.state_details.flow_run_id
    subflows = [r.id for r in _read(_child_flow_runs(flow_run_id))]
    arts = _read(_artifacts([flow_run_id, *subflows]))
    keys = [a.key for a in arts]
    assert keys.count("omniflow-epoch-metrics") == 2
    assert keys.count("omniflow-checkpoint") == 2
    assert "omniflow-progress" in keys
    card = next(a for a in arts if a.key == "omniflow-checkpoint" and "global_step_2" in (a.description or ""))
    assert "sha256" in card.data and str(ckpt) in card.data

    # Metrics under verl-omni's names, one JSONL record per step.
    from omni_core.tracking import read_jsonl

    records = read_jsonl(Path(result.log_dir) / "metrics.jsonl")
    step_records = [r for r in records if "critic/rewards/mean" in r]
    assert [r["step"] for r in step_records] == [1, 2]
    for key in (
        "actor/pg_loss",
        "actor/grad_norm",
        "actor/lr",
        "timing_s/gen",
        "timing_s/update_actor",
        "perf/throughput",
        "critic/rewards/zero_std_ratio",
    ):
        assert key in step_records[0], key
    # The on-policy ratio of the first update is exactly 1 (old log-probs recomputed in the same layout).
    assert step_records[0]["actor/ratio_mean"] == 1.0


def test_a_run_of_a_finished_experiment_trains_nothing_and_says_so_in_its_state_and_summary(
    flows, reference, flow_overrides, tmp_path
):
    """The reference's experiment (2 of 2 steps done), run again on a copy of its folder, as a UI trigger of the
    on-demand deployment does: it completes having started nothing past reading the data, and the flow run's state message in the API and its
    summary artifact say so and how to start a new experiment; the checkpoints stay as they were."""
    import shutil

    from prefect.client.orchestration import get_client

    _, _, ckpt = reference
    folder = tmp_path / "ckpt"
    shutil.copytree(ckpt, folder)
    before = sorted(p.name for p in folder.iterdir())
    state = flows.main_diffusion_v1(overrides=[*flow_overrides, f"trainer.default_local_dir={folder}"], return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert result.global_step == 2 and result.final_metrics == {} and Path(result.final_checkpoint).name == "global_step_2"

    async def stored():
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        async with get_client() as client:
            run_id = state.state_details.flow_run_id
            tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
            return await client.read_flow_run(run_id), tasks

    flow_run, tasks = _read(stored())
    message = flow_run.state.message
    # It read the data and stopped there: no Ray task, TransferQueue, model or actor was started.
    assert sorted(t.name.rsplit("-", 1)[0] for t in tasks) == [
        "load_tokenizer",
        "prepare_dataset",
        "validate_config",
    ]
    assert "was already complete at step 2" in message and "trained nothing" in message and result.note == message
    assert "trainer.experiment_name=<new name>" in message and "new_experiment_per_run=true" in message
    (summary,) = [a for a in _read(_artifacts([state.state_details.flow_run_id])) if a.key == "omniflow-run-summary"]
    assert summary.description.startswith("Nothing trained: ") and "**Nothing trained**" in summary.data
    assert (folder / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert [p for p in sorted(p.name for p in folder.iterdir()) if p != "logs"] == [p for p in before if p != "logs"]


def test_transfer_queue_holds_no_rows_after_the_run(reference):
    from omni_core.tq.client import attach, list_rows, partition_id

    _, result, _ = reference
    attach()  # the run detached this process's client when it closed (the controller is the session's)
    assert list_rows(partition_id(result.run_id, "train")) == {}
    assert list_rows(partition_id(result.run_id, "val")) == {}


def test_subflow_run_hits_the_cache_and_recovers_a_killed_actor(flows, reference, flow_overrides, tmp_path):
    """A second run, nested in a parent flow, whose training actor is SIGKILLed after the first checkpoint.

    Its setup tasks come from the reference run's cache, epoch 1 recovers the actor (restarted by Ray with
    the base weights) from the step-1 checkpoint, the parent gets the typed result, and the weights equal
    the fault-free run's bit for bit.
    """
    import ray
    from prefect import flow

    ckpt = tmp_path / "ckpt"
    killed: list[int] = []

    def kill_after_first_checkpoint() -> None:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and not (ckpt / "global_step_1" / "manifest.json").exists():
            time.sleep(0.2)
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if "fault" in entry["name"] and entry["name"].endswith("training-actor"):
                pid = ray.get(ray.get_actor(entry["name"], namespace=entry["namespace"]).pid.remote(), timeout=60)
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

    @flow(name="parent-pipeline")
    def parent() -> object:
        return flows.main_diffusion_v1(
            overrides=[*flow_overrides, f"trainer.default_local_dir={ckpt}", "trainer.experiment_name=fault"]
        )

    watcher = threading.Thread(target=kill_after_first_checkpoint, daemon=True)
    watcher.start()
    state = parent(return_state=True)
    watcher.join(timeout=30)
    assert state.is_completed(), state.message
    result = state.result()
    assert type(result).__name__ == "TrainResult" and result.global_step == 2
    assert killed, "the training actor was not found to kill"

    # The setup tasks of this (second) run came from the cache of the reference run.
    assert _read(_latest_task_state("load_tokenizer")) == "Cached"
    assert _read(_latest_task_state("prepare_dataset")) == "Cached"
    assert_same_weights(final_weights(ckpt), final_weights(reference[2]))

    # The recovery path that ran: Ray restarted the killed actor once (base weights, version 0), and epoch 1
    # (first try, or its retry if the kill hit one of its calls) reset it to the step-1 checkpoint.
    from ray.util.state import list_actors

    (actor,) = list_actors(
        address=ray.get_runtime_context().gcs_address,  # this session's cluster, whatever else runs on the machine
        filters=[("name", "=", f"omniflow-{result.run_id}-training-actor")],
        detail=True,
        limit=100,
    )
    assert actor.num_restarts == 1, actor
    reset = "training actor reset to step 1 (its weights were at step 0)"
    messages = _wait_for_log_lines(state.state_details.flow_run_id, lambda m: reset in m)
    resets = [m for m in messages if m.startswith("training actor reset")]
    assert resets == [reset], resets


def test_asking_for_a_gpu_fails_fast_with_the_key(flows, flow_overrides, tmp_path):
    """More GPUs than the machine has: none on a CPU machine, one more than present on a GPU machine."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ask = ["trainer.device=cuda"] if gpus == 0 else ["trainer.device=cuda", f"trainer.n_gpus_per_node={gpus + 1}"]
    key = "trainer.device" if gpus == 0 else "trainer.n_gpus_per_node"
    start = time.monotonic()
    state = flows.main_diffusion_v1(overrides=[*flow_overrides, f"trainer.default_local_dir={tmp_path}", *ask], return_state=True)
    assert state.is_failed()
    assert key in state.message
    assert time.monotonic() - start < 60
    assert not (tmp_path / "global_step_1").exists()


def test_cluster_device_check_names_the_key():
    from omni_core.config import ConfigError, load_config
    from omni_core.distributed.ray_cluster import check_cluster_devices

    cfg = load_config(overrides=["trainer.device=cuda", "trainer.n_gpus_per_node=2"])
    with pytest.raises(ConfigError) as err:
        check_cluster_devices(cfg, {"CPU": 16.0, "GPU": 1.0})
    assert "trainer.n_gpus_per_node" in str(err.value) and "pending forever" in str(err.value)
    with pytest.raises(ConfigError, match="ray_kwargs.ray_init.num_cpus"):
        check_cluster_devices(load_config(), {"CPU": 2.0})
    check_cluster_devices(load_config(), {"CPU": 16.0})
