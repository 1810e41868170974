"""Process faults and retries (issue 11): repeated init stages, out-of-memory errors and which failures
Prefect retries, killed rollout workers / TransferQueue actors, duplicate metrics after a retried epoch.

Every fault is real: a second init call as Prefect's retry makes it, an allocation past a real memory
limit, a SIGKILL to a real pid found through Ray's state API.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# The group: shares that session run with other modules (conftest).
pytestmark = [pytest.mark.timeout(600), pytest.mark.xdist_group("separate_workers_run")]


def _actors_named(name: str) -> list:
    import ray
    from ray.util.state import list_actors

    return list_actors(address=ray.get_runtime_context().gcs_address, filters=[("name", "=", name)], detail=True, limit=100)


# ----------------------------------------------------------------------------------------- item 13
def test_repeated_init_stages_reuse_the_run_actors(ray_cluster, transfer_queue, flow_overrides, tmp_path, one_torch_thread):
    """`init_trainer` and `init_agent_loop` called twice (as a Prefect retry calls them, in the same process)
    end with one live actor per name, not "name already taken"; the placement group is reused too."""
    import ray

    from omni_core.config import load_config
    from omni_core.data.prompts import PromptRecord
    from omni_core.distributed.worker_pool import pool_name
    from omni_core.records import RunInfo
    from omni_core.trainers import build_diffusion_trainer

    # Separate rollout workers (not the hybrid engine's ranks): actors of their own that a retry must reuse.
    overrides = [*flow_overrides, "actor_rollout_ref.hybrid_engine=false", f"trainer.default_local_dir={tmp_path / 'ckpt'}"]
    cfg = load_config(overrides=overrides)
    run = RunInfo(
        run_id="repeat-init", namespace="omniflow", checkpoint_dir=str(tmp_path / "ckpt"), log_dir=str(tmp_path / "logs")
    )
    train = [PromptRecord("a red circle", index=0), PromptRecord("a blue square", index=1)]
    trainer = build_diffusion_trainer(cfg, run)
    try:
        trainer.init(train, [])
        first_actor = trainer.actor._actor_id
        trainer.init(train, [])  # the retry
        assert trainer.actor._actor_id == first_actor
        first_workers = [w._actor_id for w in trainer.init_agent_loop().workers]
        assert [w._actor_id for w in trainer.init_agent_loop().workers] == first_workers
        for name in (run.names.training_actor, run.names.rollout_worker(0)):
            actors = _actors_named(name)
            assert [a.state for a in actors] == ["ALIVE"], (name, actors)
        pools = [g for g in ray.util.placement_group_table().values() if g["name"] == pool_name(run.names)]
        assert [g["state"] for g in pools] == ["CREATED"]
    finally:
        trainer.close()


def test_a_retried_cluster_start_still_owns_the_ray_cluster_it_started(tmp_path):
    """In a fresh process: `start_run_cluster` twice (the init_transfer_queue task and its retry) reports
    ownership both times, and `close_run` then stops Ray and the TransferQueue (nothing leaks)."""
    script = textwrap.dedent(
        """
        import ray
        from omni_core.config import load_config
        from omni_core.distributed.ray_cluster import close_run, start_run_cluster

        cfg = load_config(overrides=["ray_kwargs.ray_init.num_cpus=8", "transfer_queue.backend.SimpleStorage.num_data_storage_units=1"])
        first = start_run_cluster(cfg).owns_ray
        second = start_run_cluster(cfg).owns_ray
        close_run(None, second)
        print("OWNS", first, second, ray.is_initialized())
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a cluster of its own
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert "OWNS True True False" in out.stdout, out.stdout + out.stderr


# ----------------------------------------------------------------------------------------- item 12
def _raised(fn) -> BaseException:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001  (the test wants whatever it raised)
        return exc
    raise AssertionError("nothing was raised")


def test_only_infrastructure_failures_are_retried(ray_cluster):
    """Real exceptions from Ray (a killed actor, a timed-out get, a task whose code raised) and from OmniFlow."""
    import ray
    import torch

    from omni_core.config import ConfigError, load_config
    from omni_core.faults import RunOutOfMemoryError, is_out_of_memory, is_retryable, out_of_memory_error
    from omni_core.rewards.manager import RewardFailureError

    @ray.remote(num_cpus=0)
    class Sleeper:
        def sleep(self, s: float) -> None:
            import time

            time.sleep(s)

    @ray.remote(num_cpus=0, max_retries=0)
    def user_code() -> None:
        raise ValueError("a bug in a reward file")

    @ray.remote(num_cpus=0, max_retries=0)
    def allocates() -> None:
        torch.empty(1 << 60, dtype=torch.uint8)  # an exabyte: the CPU allocator refuses

    actor = Sleeper.remote()
    timed_out = _raised(lambda: ray.get(actor.sleep.remote(30), timeout=0.1))
    pending = actor.sleep.remote(30)
    ray.kill(actor)
    died = _raised(lambda: ray.get(pending, timeout=60))
    user_error = _raised(lambda: ray.get(user_code.remote(), timeout=60))
    oom_in_task = _raised(lambda: ray.get(allocates.remote(), timeout=60))

    assert type(timed_out).__name__ == "GetTimeoutError" and is_retryable(timed_out)
    assert isinstance(died, ray.exceptions.RayActorError) and is_retryable(died)
    assert is_retryable(ray.exceptions.NodeDiedError("node-1")) and is_retryable(ray.exceptions.WorkerCrashedError())
    assert isinstance(user_error, ValueError) and not is_retryable(user_error)
    assert is_out_of_memory(oom_in_task) and not is_retryable(oom_in_task), oom_in_task
    assert not is_retryable(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_retryable(ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory."))
    assert not is_retryable(_raised(lambda: load_config(overrides=["data.train_batch_size=oops"])))
    assert not is_retryable(ConfigError([]))
    assert not is_retryable(RewardFailureError("jpeg_compressibility failed for 8 of 8 samples"))
    # An infrastructure error raised while handling a config error is still not retried (the chain decides).
    try:
        try:
            raise ConfigError([])
        except ConfigError as cfg_err:
            raise ray.exceptions.GetTimeoutError("wait") from cfg_err
    except Exception as chained:
        assert not is_retryable(chained)
    # A dead TransferQueue actor: no plain retry (it would meet the same dead queue); the flow restarts TQ first.
    from omni_core.faults import is_transfer_queue_lost
    from omni_core.tq.client import TransferQueueUnavailableError

    try:
        try:
            raise TransferQueueUnavailableError("TransferQueueStorageUnit#1 died")
        except TransferQueueUnavailableError as lost:
            raise ray.exceptions.ActorDiedError() from lost
    except Exception as chained:
        assert is_transfer_queue_lost(chained) and not is_retryable(chained)
    assert not is_transfer_queue_lost(died)
    error = out_of_memory_error(load_config(), oom_in_task, "step 3")
    assert isinstance(error, RunOutOfMemoryError) and not is_retryable(error)


def test_prefect_retries_an_infrastructure_failure_but_not_a_config_error(prefect_api):
    from omniflow.tasks.retry_policy import retry_infrastructure_failures
    from prefect import flow, task
    from ray.exceptions import GetTimeoutError

    from omni_core.config import ConfigError

    calls: list[str] = []

    @task(retries=2, retry_delay_seconds=0, retry_condition_fn=retry_infrastructure_failures)
    def failing(kind: str) -> None:
        calls.append(kind)
        raise GetTimeoutError("actor call timed out") if kind == "infra" else ConfigError([])

    @flow
    def both() -> None:
        for kind in ("infra", "config"):
            failing(kind, return_state=True)

    both()
    assert calls == ["infra"] * 3 + ["config"]


def test_a_real_out_of_memory_update_says_which_settings_to_change(tiny_sd3_dir, tmp_path):
    """A FlowPolicy forward/backward with a huge micro-batch in a process whose address space is capped
    (RLIMIT_AS): the CPU allocator fails for real, and the error names the settings that lower memory."""
    script = textwrap.dedent(
        f"""
        import resource, torch
        torch.set_num_threads(1)
        from omni_core.config import load_config
        from omni_core.faults import is_out_of_memory, is_retryable, out_of_memory_error
        from omni_core.models.policy import FlowPolicy

        policy = FlowPolicy({str(tiny_sd3_dir)!r})
        batch = 2048  # the micro-batch: ~GBs of activations at 32 px
        cond = policy.encode_prompts(["a cat"], max_sequence_length=8)
        cond = {{k: v.expand(batch, *v.shape[1:]) for k, v in cond.items()}}
        latents = policy.prepare_latents(batch, 32, 32)
        vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize"))
        limit = vm * 1024 + 512 * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            policy.velocity(latents, torch.full((batch,), 700.0), cond).square().mean().backward()
            print("NO OOM")
        except Exception as exc:
            print("OOM", is_out_of_memory(exc), is_retryable(exc))
            print(out_of_memory_error(load_config(), exc, "step 1"))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert "OOM True False" in out.stdout, out.stdout + out.stderr[-3000:]
    for key in (
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "data.gen_batch_size",
        "actor_rollout_ref.actor.fsdp_config.dtype=",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "actor_rollout_ref.model.lora_rank=0",
        "out of memory during step 1",
    ):
        assert key in out.stdout, (key, out.stdout)


# ---------------------------------------------------------------------------------------- item 9
def test_a_killed_rollout_worker_is_replaced_and_the_weights_match(flow_reference, separate_workers_run):
    """SIGKILL a real RolloutWorker's process (the session's shared run with two separate workers) after the first
    checkpoint: Ray restarts it (max_restarts), it gets the current weights again (or the epoch is retried from its
    checkpoint if the kill hit a call), and the final weights equal the fault-free (hybrid-engine) run's bit for bit;
    metrics.jsonl keeps one record per step."""
    from flow_utils import assert_same_weights, final_weights

    from omni_core.tracking import read_jsonl

    state, ckpt, killed = separate_workers_run
    assert killed, "no rollout worker was found to kill"
    assert state.is_completed(), state.message
    result = state.result()
    assert result.global_step == 2
    (worker,) = _actors_named(f"omniflow-{result.run_id}-rollout-worker-0")
    assert worker.num_restarts == 1, worker
    (other,) = _actors_named(f"omniflow-{result.run_id}-rollout-worker-1")
    assert other.num_restarts == 0, other
    assert_same_weights(final_weights(ckpt), final_weights(flow_reference[2]))
    steps = [r["step"] for r in read_jsonl(os.path.join(result.log_dir, "metrics.jsonl")) if "critic/rewards/mean" in r]
    assert steps == [1, 2]


# --------------------------------------------------------------------------------------- item 10
def _task_runs_of(flow_run_id) -> list:
    """Every task run of the flow run and of its subflows (`fit`), from the Prefect API."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId

    async def read() -> list:
        async with get_client() as client:
            children = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
            )
            ids = [flow_run_id, *(c.id for c in children)]
            return await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))

    return asyncio.run(read())


@pytest.mark.parametrize(
    ("victim", "class_name"),
    [("TransferQueueStorageUnit#1", "SimpleStorageUnit"), ("TransferQueueController", "TransferQueueController")],
)
def test_a_killed_transfer_queue_actor_is_replaced_and_the_epoch_redone(
    flow_reference, flow_overrides, tmp_path, victim, class_name
):
    """SIGKILL one TransferQueue storage unit (the controller lives on, its rows point at the dead unit) or the
    controller itself, after the first checkpoint: the epoch that meets the dead queue fails with
    TransferQueueUnavailableError within seconds instead of waiting forever, the flow starts a new
    TransferQueue (`restart_transfer_queue`) and redoes the epoch from its checkpoint, and the final weights
    equal the fault-free run's bit for bit; metrics.jsonl keeps one record per step."""
    import ray
    from flow_utils import assert_same_weights, final_weights, run_with_kill

    from omni_core.tq import client as tqc
    from omni_core.tracking import read_jsonl

    ckpt = tmp_path / "ckpt"
    # The restart builds a TransferQueue with the run's settings: those of the session's (2 storage units, conftest),
    # so that the cluster's layout comes back as the other tests know it (the default, null, sizes it from the machine).
    overrides = [*flow_overrides, "transfer_queue.backend.SimpleStorage.num_data_storage_units=2"]
    state, killed = run_with_kill(overrides, ckpt, f"tqkill-{class_name.lower()}", victim, class_name)
    assert killed, f"no {victim} was found to kill"
    assert state.is_completed(), state.message
    result = state.result()
    assert result.global_step == 2
    assert_same_weights(final_weights(ckpt), final_weights(flow_reference[2]))
    steps = [r["step"] for r in read_jsonl(os.path.join(result.log_dir, "metrics.jsonl")) if "critic/rewards/mean" in r]
    assert steps == [1, 2]

    runs = _task_runs_of(state.state_details.flow_run_id)
    restarts = [r.state.type.value for r in runs if r.name.startswith("restart_transfer_queue")]
    epoch_1 = sorted(r.state.type.value for r in runs if r.name == "fit_epoch-1")
    assert restarts == ["COMPLETED"], [(r.name, r.state.type.value) for r in runs]
    assert epoch_1 == ["COMPLETED", "FAILED"], [(r.name, r.state.type.value) for r in runs]
    failed = next(r for r in runs if r.name == "fit_epoch-1" and r.state.type.value == "FAILED")
    assert "TransferQueue" in (failed.state.message or ""), failed.state.message
    # The cluster's TransferQueue is whole again (the session's other tests go on using it).
    assert tqc.dead_transfer_queue_actors() == []
    # The victim's name now belongs to one live actor of its class, in another process than the one killed, that
    # answers a call (ray.get_actor alone only says the name is registered: it raises when it is not).
    namespace = dict(tqc._transfer_queue_actor_names())[victim]
    live = [a for a in _actors_named(victim) if a.state == "ALIVE"]
    assert [(a.class_name, a.pid in killed) for a in live] == [(class_name, False)], live
    assert ray.get(ray.get_actor(victim, namespace=namespace).__ray_ready__.remote(), timeout=60) is True


# --------------------------------------------------------------------------------------- item 15
def test_a_retried_epoch_leaves_one_record_per_step(tmp_path):
    """The failed try logged steps 3 and 4 (and val at 4) before dying; the retry restarts from step 2 and logs
    3 and 4 again: metrics.jsonl and TensorBoard end with one record per step, the retry's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from omni_core.tracking import Tracking, read_jsonl

    first = Tracking(["file", "tensorboard"], tmp_path, total_steps=4)
    for step in (1, 2, 3, 4):
        first.log({"actor/pg_loss": float(step)}, step=step)
    first.close()  # (the process died here)
    retry = Tracking(["file", "tensorboard"], tmp_path, total_steps=4, resume_step=2)
    for step in (3, 4):
        retry.log({"actor/pg_loss": 10.0 * step}, step=step)
    retry.close()

    assert [(r["step"], r["actor/pg_loss"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [
        (1, 1.0),
        (2, 2.0),
        (3, 30.0),
        (4, 40.0),
    ]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("actor/pg_loss")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    # A fresh start (step 0) keeps nothing of an earlier try, and no resume_step keeps everything.
    Tracking(["file"], tmp_path, total_steps=4, resume_step=0).close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == []
