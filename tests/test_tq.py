"""omni_core.tq against the real Ray cluster and the real TransferQueue of the test session."""

from __future__ import annotations

import os
import random
import re
import sys
import time

import pytest
import ray
import torch

from omni_core.tq import (
    FAILURE,
    FINISHED,
    PENDING,
    RUNNING,
    ReplayBuffer,
    TransferQueueCapacityError,
    check_ray_capacity,
    clear,
    clear_partition,
    get_trajectories,
    init_transfer_queue,
    list_rows,
    partition_id,
    put_prompts,
    put_trajectories,
    set_prompt_status,
    trajectory_key,
    uid_of_key,
)
from omni_core.tq.client import _to_tq_conf

# Ray workers cannot import this test module (tests/ is not a package): ship its code by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

W, C, H = 3, 4, 8  # SDE window length, latent channels, latent height = width


def _group(uid: str, n: int, step: int, *, model_version: int = 0, w: int = W) -> tuple[list[str], dict, list[dict]]:
    """A rollout group of ``n`` samples whose values are a function of (uid, sample index) only."""
    keys = [trajectory_key(uid, s) for s in range(n)]
    seed = sum(map(ord, uid))
    gen = torch.Generator().manual_seed(seed)
    fields = {
        "latents": torch.randn(n, w + 1, C, H, H, generator=gen),
        "log_probs": torch.randn(n, w, generator=gen),
        "timesteps": torch.linspace(1000, 100, w).repeat(n, 1),
        "prompt_embeds": torch.randn(n, 5, 16, generator=gen),
        "images": torch.randint(0, 256, (n, 3, 16, 16), generator=gen, dtype=torch.uint8),
        "rewards": torch.arange(n, dtype=torch.float32) + seed,
        "failed": torch.zeros(n, dtype=torch.bool),
        "prompts": [f"prompt of {uid}"] * n,
    }
    tags = [{"status": "success", "global_steps": step, "model_version": model_version} for _ in keys]
    return keys, fields, tags


@ray.remote(num_cpus=0)
class Producer:
    """A rollout worker stand-in: its own process, joins the driver's TransferQueue with a bare init."""

    def __init__(self) -> None:
        from omni_core.tq import attach

        attach()

    def ping(self) -> bool:
        return True

    def produce(self, partition: str, uid: str, n: int, step: int, delay_s: float = 0.0) -> list[str]:
        time.sleep(delay_s)
        set_prompt_status(partition, [uid], RUNNING)
        keys, fields, tags = _group(uid, n, step)
        order = list(range(n))
        random.Random(uid).shuffle(order)  # rows land out of order, as from several workers
        put_trajectories(
            partition, [keys[i] for i in order], {k: _pick(v, order) for k, v in fields.items()}, [tags[i] for i in order]
        )
        set_prompt_status(partition, [uid], FINISHED)
        return keys

    def detach(self) -> None:
        from omni_core.tq import detach

        detach()


def _pick(value, order):
    return value[order] if isinstance(value, torch.Tensor) else [value[i] for i in order]


@pytest.fixture
def part(request, transfer_queue) -> str:
    """A partition of its own per test (the session shares one controller, as runs share a cluster)."""
    run_id = re.sub(r"[^A-Za-z0-9]", "-", request.node.name)
    pid = partition_id(run_id, "train")
    yield pid
    clear_partition(pid)


@pytest.fixture(scope="module")
def producers(transfer_queue) -> list:
    """Two rollout-worker stand-ins, started together: each start costs ~8 s on 2 cores (torch and
    transfer_queue imports), so they overlap. ``[0]`` serves; ``[1]`` is the one a test detaches and kills."""
    actors = [Producer.remote() for _ in range(2)]
    ray.get([a.ping.remote() for a in actors], timeout=90)
    yield actors
    for actor in actors:
        ray.kill(actor)


@pytest.fixture
def producer(producers):
    return producers[0]


# ------------------------------------------------------------------------------------- pure rules
@pytest.mark.timeout(10)
def test_names_and_keys():
    assert partition_id("runA", "train") == "runA/train"
    assert partition_id("runA", "val") == "runA/val"
    with pytest.raises(ValueError, match="split"):
        partition_id("runA", "test")  # type: ignore[arg-type]
    key = trajectory_key("s3_p_7", 2)  # uids may hold '_'; session and index may not
    assert key == "s3_p_7_2_0"
    assert uid_of_key(key) == "s3_p_7"
    with pytest.raises(ValueError):
        trajectory_key("u", "a_b")


@pytest.mark.timeout(10)
def test_capacity_check_names_the_keys_to_change():
    check_ray_capacity({"CPU": 3.0}, num_storage_units=2)  # controller 1 + 2 units fits exactly
    with pytest.raises(TransferQueueCapacityError) as err:
        check_ray_capacity({"CPU": 2.0}, num_storage_units=2, cluster={"CPU": 2.0})
    msg = str(err.value)
    assert "needs 3 logical Ray CPUs" in msg and "2 available" in msg
    assert "ray_kwargs.ray_init.num_cpus" in msg
    assert "transfer_queue.backend.SimpleStorage.num_data_storage_units=2" in msg
    # Enough declared, but held by other actors: the fix is the start order.
    with pytest.raises(TransferQueueCapacityError, match="other actors hold the rest"):
        check_ray_capacity({"CPU": 1.0}, num_storage_units=8, cluster={"CPU": 16.0})
    with pytest.raises(TransferQueueCapacityError):
        check_ray_capacity({}, num_storage_units=1)


@pytest.mark.timeout(10)
def test_init_refuses_without_ray(monkeypatch):
    from omni_core.config.schema import TransferQueueConfig

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"ray_kwargs\.ray_init"):
        init_transfer_queue(TransferQueueConfig())


@pytest.mark.timeout(10)
def test_config_section_becomes_tq_conf():
    from omni_core.config.schema import TransferQueueConfig

    conf = _to_tq_conf(TransferQueueConfig())
    assert "enable" not in conf  # verl's switch, not a TQ key
    assert conf.backend.storage_backend == "SimpleStorage"
    # null (the default) is sized from this machine: 1 unit per 16 logical CPUs, 1 to 8.
    assert conf.backend.SimpleStorage.num_data_storage_units == max(1, min(8, (os.cpu_count() or 1) // 16))
    set_to_3 = TransferQueueConfig.model_validate({"backend": {"SimpleStorage": {"num_data_storage_units": 3}}})
    assert _to_tq_conf(set_to_3).backend.SimpleStorage.num_data_storage_units == 3


@pytest.mark.timeout(10)
def test_auto_storage_units_follow_the_machine_with_verl_omnis_eight_on_big_ones():
    from omni_core.resources import auto_storage_units

    sizes = {cpus: auto_storage_units(cpus) for cpus in (1, 2, 15, 16, 31, 32, 64, 127, 128, 512)}
    assert sizes == {1: 1, 2: 1, 15: 1, 16: 1, 31: 1, 32: 2, 64: 4, 127: 7, 128: 8, 512: 8}


# ------------------------------------------------------------------------------------- real TQ
@pytest.mark.timeout(120)  # the first test on the cluster pays Ray + TQ start-up (~25 s on 2 cores)
def test_init_attaches_to_running_controller(transfer_queue):
    from ray.util.state import list_actors

    from omni_core.config.schema import TransferQueueConfig

    def alive_controllers() -> list:
        return list_actors(
            address=ray.get_runtime_context().gcs_address,  # this session's cluster, whatever else runs on the machine
            filters=[("name", "=", "TransferQueueController"), ("state", "=", "ALIVE")],
            limit=100,
        )

    (before,) = alive_controllers()
    # The session already started TQ: a second init (another run on the cluster) joins it.
    assert init_transfer_queue(TransferQueueConfig()) is False
    # Still the one controller the session started (none replaced, none added), and it serves requests.
    assert [(a.actor_id, a.class_name, a.ray_namespace) for a in alive_controllers()] == [
        (before.actor_id, before.class_name, "transfer_queue")
    ]
    pid = partition_id("second-init", "train")
    try:
        put_prompts(pid, ["u"], global_step=3)
        assert list_rows(pid) == {"u": {"is_prompt": True, "status": PENDING, "global_steps": 3}}
    finally:
        clear_partition(pid)


@pytest.mark.timeout(90)
def test_rows_put_by_a_ray_actor_are_read_in_the_driver(producer, part):
    put_prompts(part, ["u1"], global_step=4)
    keys = ray.get(producer.produce.remote(part, "u1", 4, 4), timeout=60)
    got = get_trajectories(part, keys)
    _, want, _ = _group("u1", 4, 4)
    for name, value in want.items():
        if isinstance(value, torch.Tensor):
            assert not got[name].is_nested and got[name].dtype == value.dtype, name
            torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
        else:
            assert got[name] == value
    assert got["latents"].shape == (4, W + 1, C, H, H)
    rows = list_rows(part)
    assert rows["u1"] == {"is_prompt": True, "status": FINISHED, "global_steps": 4}
    assert rows[keys[0]] == {"is_prompt": False, "uid": "u1", "status": "success", "global_steps": 4, "model_version": 0}


@pytest.mark.timeout(60)
def test_keys_come_back_sorted_whatever_the_put_order(transfer_queue, part):
    keys, fields, tags = _group("g", 6, 1)
    order = [4, 1, 5, 0, 3, 2]
    for chunk in (order[:3], order[3:]):  # two puts, like two workers
        put_trajectories(
            part, [keys[i] for i in chunk], {k: _pick(v, chunk) for k, v in fields.items()}, [tags[i] for i in chunk]
        )
    asked = [keys[i] for i in (2, 0, 5, 1, 4, 3)]
    got = get_trajectories(part, asked, select_fields=["rewards", "prompts", "latents"])
    assert sorted(got) == ["latents", "prompts", "rewards"]
    torch.testing.assert_close(got["rewards"], fields["rewards"])  # keys g_0_0 .. g_5_0 sort like indexes
    torch.testing.assert_close(got["latents"], fields["latents"])


@pytest.mark.timeout(60)
def test_jagged_fields_are_densified_when_shapes_agree(transfer_queue, part):
    keys, fields, tags = _group("j", 2, 0)
    put_trajectories(part, keys, fields, tags)
    raw = transfer_queue.kv_batch_get(keys=keys, partition_id=part, select_fields=["log_probs", "rewards"])
    assert raw["log_probs"].is_nested  # TQ's own return for a stacked field: jagged
    assert not raw["rewards"].is_nested  # scalars per row are stacked densely
    assert get_trajectories(part, keys, ["log_probs"])["log_probs"].shape == (2, W)
    # Rows with different window lengths cannot be stacked: the nested tensor is kept.
    keys2, fields2, tags2 = _group("k", 2, 0, w=W + 2)
    put_trajectories(part, keys2, {"log_probs": fields2["log_probs"]}, tags2)
    mixed = get_trajectories(part, keys + keys2, ["log_probs"])["log_probs"]
    assert mixed.is_nested and [t.shape[0] for t in mixed.unbind()] == [W, W, W + 2, W + 2]


@pytest.mark.timeout(60)
def test_prompt_status_transitions(transfer_queue, part):
    put_prompts(part, ["b", "a"], global_step=7)
    assert list_rows(part) == {
        "b": {"is_prompt": True, "status": PENDING, "global_steps": 7},
        "a": {"is_prompt": True, "status": PENDING, "global_steps": 7},
    }
    set_prompt_status(part, ["a", "b"], RUNNING)
    set_prompt_status(part, ["a"], FINISHED)
    set_prompt_status(part, ["b"], FAILURE, reason="reward server timed out")
    rows = list_rows(part)
    assert rows["a"] == {"is_prompt": True, "status": FINISHED, "global_steps": 7}
    assert rows["b"] == {"is_prompt": True, "status": FAILURE, "global_steps": 7, "reason": "reward server timed out"}
    with pytest.raises(ValueError, match="status"):
        set_prompt_status(part, ["a"], "done")
    with pytest.raises(ValueError, match="model_version"):
        put_trajectories(part, ["a_0_0"], {"rewards": torch.zeros(1)}, [{"status": "success", "global_steps": 7}])


@pytest.mark.timeout(60)
def test_partitions_are_independent(transfer_queue):
    a, b = partition_id("runA", "train"), partition_id("runB", "train")
    try:
        for pid, value in ((a, 1.0), (b, 2.0)):
            put_prompts(pid, ["u"], global_step=0)
            put_trajectories(
                pid, ["u_0_0"], {"rewards": torch.tensor([value])}, [{"status": "success", "global_steps": 0, "model_version": 0}]
            )
        assert get_trajectories(a, ["u_0_0"])["rewards"].tolist() == [1.0]
        assert get_trajectories(b, ["u_0_0"])["rewards"].tolist() == [2.0]
        assert clear_partition(a) == 2
        assert list_rows(a) == {}
        assert set(list_rows(b)) == {"u", "u_0_0"}
        with pytest.raises(KeyError):
            get_trajectories(a, ["u_0_0"])
        with pytest.raises(KeyError, match="u_1_0"):  # TQ alone would return 1 row without a word
            get_trajectories(b, ["u_0_0", "u_1_0"])
    finally:
        clear_partition(a)
        clear_partition(b)
    assert list_rows(b) == {}


# ------------------------------------------------------------------------------------ replay buffer
def _write_group(part: str, uid: str, n: int, step: int, status: str = FINISHED, reason: str | None = None) -> list[str]:
    keys, fields, tags = _group(uid, n, step)
    put_trajectories(part, keys, fields, tags)
    set_prompt_status(part, [uid], status, reason)
    return keys


@pytest.mark.timeout(60)
def test_replay_buffer_returns_oldest_complete_groups(transfer_queue, part):
    put_prompts(part, ["c"], global_step=2)
    put_prompts(part, ["z", "b"], global_step=1)
    put_prompts(part, ["a"], global_step=1)
    keys_c = _write_group(part, "c", 2, 2)
    keys_z = _write_group(part, "z", 2, 1)
    keys_b = _write_group(part, "b", 1, 1, FAILURE, reason="decode error")  # partial group, still handed out
    _write_group(part, "a", 1, 1)  # finished, but 1 of 2 rows: not complete
    buffer = ReplayBuffer(part, poll_interval=0.05, timeout_s=5)
    batch = buffer.sample(batch_size=2, global_step=2, group_size=2)
    assert batch.prompt_uids == ["b", "z"]  # step 1 before step 2, then by uid; "a" is incomplete
    assert batch.trajectory_keys == sorted(keys_b + keys_z)
    assert batch.failed_uids == {"b": "decode error"}
    rows = list_rows(part)
    assert "b" not in rows and "z" not in rows and {"a", "c"} <= set(rows)  # consumed prompt rows cleared
    assert set(keys_b + keys_z) <= set(rows)  # trajectory rows stay until the trainer clears them
    clear(part, batch.trajectory_keys)
    assert buffer.sample(batch_size=1, global_step=2, group_size=2).trajectory_keys == keys_c


@pytest.mark.timeout(90)
def test_replay_buffer_waits_for_a_remote_producer(producer, part):
    put_prompts(part, ["late"], global_step=0)
    ref = producer.produce.remote(part, "late", 3, 0, delay_s=0.5)
    batch = ReplayBuffer(part, poll_interval=0.05, timeout_s=30).sample(batch_size=1, global_step=0, group_size=3)
    assert batch.prompt_uids == ["late"] and batch.trajectory_keys == ray.get(ref, timeout=30)


@pytest.mark.timeout(90)
def test_worker_detach_keeps_the_queue_and_a_dead_worker_fails_sample_fast(producers, part):
    actor = producers[1]
    put_prompts(part, ["p0"], global_step=0)
    ray.get(actor.detach.remote(), timeout=60)
    assert list_rows(part)["p0"]["status"] == PENDING  # tq.close() in the worker would have killed the controller
    ray.kill(actor)

    def liveness_check() -> None:
        ray.get(actor.ping.remote(), timeout=10)  # raises RayActorError once the actor is gone

    start = time.monotonic()
    with pytest.raises(ray.exceptions.RayActorError):
        ReplayBuffer(part, poll_interval=0.05, timeout_s=300, liveness_check=liveness_check).sample(1, 0, 2)
    assert time.monotonic() - start < 10


@pytest.mark.timeout(60)
def test_sample_times_out_with_counts(transfer_queue, part):
    put_prompts(part, ["p", "r", "f"], global_step=0)
    set_prompt_status(part, ["r"], RUNNING)
    _write_group(part, "f", 1, 0)  # finished, but 1 of 2 rows
    buffer = ReplayBuffer(part, poll_interval=0.05, timeout_s=0.3)
    start = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        buffer.sample(batch_size=1, global_step=3, group_size=2)
    assert time.monotonic() - start >= 0.3  # it waited its timeout before giving up
    msg = str(err.value)
    assert "0 ready" in msg and "1 finished but missing" in msg and "1 pending" in msg and "1 running" in msg
    assert "global step 3" in msg and "rollout workers" in msg
    assert set(list_rows(part)) >= {"p", "r", "f"}  # nothing consumed on failure


class _WorkerGone(RuntimeError):
    pass


@pytest.mark.timeout(60)
def test_every_poll_asks_whether_the_producers_are_alive(transfer_queue, part):
    put_prompts(part, ["p"], global_step=0)  # never finished: sample keeps polling
    calls = []

    def liveness_check() -> None:
        calls.append(time.monotonic())
        if len(calls) == 3:
            raise _WorkerGone("the third poll finds the workers gone")

    # The deadline is the buffer's own timeout (300 s): the third liveness check, not the clock, ends the wait.
    buffer = ReplayBuffer(part, poll_interval=0.05, timeout_s=300, liveness_check=liveness_check)
    with pytest.raises(_WorkerGone):
        buffer.sample(batch_size=1, global_step=0, group_size=2)
    assert len(calls) == 3
    assert calls[2] - calls[1] >= 0.05  # a poll interval between polls
    assert list_rows(part) == {"p": {"is_prompt": True, "status": PENDING, "global_steps": 0}}


# ------------------------------------------------------------------------- TransferQueue and torch threads
@ray.remote(num_cpus=0)
class KernelProbe:
    """A training-actor stand-in: two torch threads, TQ traffic through omni_core.tq, then its own kernels."""

    def __init__(self) -> None:
        import transfer_queue.client

        from omni_core.tq import attach

        torch.set_num_threads(2)
        attach()
        self.tq_num_threads = transfer_queue.client.TQ_NUM_THREADS

    def waits_after_traffic(self, partition: str, uid: str) -> tuple[int, int]:
        """TQ's thread setting in this process, and the main thread's voluntary context switches over 60 rounds
        of matmul + gelu after a put and a get of a rollout-sized batch (latents 16 x 3 x 16 x 32 x 32): the
        fewest of three such windows, since load from other processes only adds switches (a preempted pool
        thread makes the main thread wait) and never removes one."""
        import psutil

        keys, fields, tags = _group(uid, 16, 1)
        fields["latents"] = torch.randn(16, 3, 16, 32, 32)
        put_trajectories(partition, keys, fields, tags)
        get_trajectories(partition, keys)
        a, w = torch.randn(64, 256, 256), torch.randn(256, 256)
        windows = []
        for _ in range(3):
            before = psutil.Process().num_ctx_switches().voluntary  # the main thread's (/proc/<pid>/status)
            for _ in range(60):
                torch.nn.functional.gelu(a @ w).add_(a)
            windows.append(psutil.Process().num_ctx_switches().voluntary - before)
        return self.tq_num_threads, min(windows)


@pytest.mark.timeout(180)
def test_tq_traffic_leaves_the_callers_torch_threads_spinning(transfer_queue, part):
    """TransferQueue's client runs torch ops in its own thread with TQ_NUM_THREADS threads (8 by default): a second
    OpenMP pool in the process, after which libgomp stops spinning in every pool and each parallel region of the
    caller's own kernels ends in futex sleeps (omni_core.tq.client). OmniFlow's default (1) avoids the second pool;
    TQ's thread count, set explicitly, is the control that shows the effect."""
    ours, control = KernelProbe.remote(), KernelProbe.options(runtime_env={"env_vars": {"TQ_NUM_THREADS": "2"}}).remote()
    # One after the other: two probes computing at once on 2 cores would preempt each other's spinning threads.
    threads, waits = ray.get(ours.waits_after_traffic.remote(part, "u-ours"), timeout=120)
    control_threads, control_waits = ray.get(control.waits_after_traffic.remote(part, "u-control"), timeout=120)
    for actor in (ours, control):
        ray.kill(actor)
    assert (threads, control_threads) == (1, 2)
    assert control_waits >= 60, f"the control slept only {control_waits} times: TransferQueue may have changed"
    assert waits * 5 <= control_waits, (waits, control_waits)
