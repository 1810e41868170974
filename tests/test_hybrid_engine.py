"""verl's hybrid engine (`actor_rollout_ref.hybrid_engine`): each training rank is also its rollout worker.

The config key is resolved (null: on wherever it can be) and refused where it cannot be on, naming the reason; the
resource plan then has no rollout slots. A training rank's `generate` writes the same TransferQueue rows, bit for
bit, as a separate `RolloutWorker` given the same weights: with the trained modules themselves (fp32 everywhere)
and with a rollout copy of its own in `rollout.dtype` (bf16 here), which must follow a real update.
"""

from __future__ import annotations

import uuid

import pytest
import torch

pytestmark = pytest.mark.timeout(900)

PROMPTS = ["a red circle", "a blue square"]


def _config(*overrides: str):
    from omni_core.config import load_config

    return load_config(overrides=list(overrides))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], True),  # the main job: sync, one rank, one worker
        (["actor_rollout_ref.rollout.agent.num_workers=2"], False),
        (
            [
                "trainer.n_gpus_per_node=2",
                "actor_rollout_ref.actor.strategy=ddp",
                "actor_rollout_ref.rollout.agent.num_workers=2",
            ],
            True,
        ),
        (
            [
                "trainer.n_gpus_per_node=2",
                "actor_rollout_ref.actor.strategy=fsdp2",
                "actor_rollout_ref.rollout.agent.num_workers=2",
            ],
            False,
        ),
        (["trainer.v1.trainer_mode=separate_async"], False),
        (["actor_rollout_ref.hybrid_engine=false"], False),
    ],
)
def test_null_turns_the_hybrid_engine_on_wherever_it_can_run(overrides, expected):
    from omni_core.resources import uses_hybrid_engine

    assert uses_hybrid_engine(_config(*overrides)) is expected


@pytest.mark.parametrize(
    ("overrides", "key", "reason"),
    [
        (["actor_rollout_ref.rollout.agent.num_workers=2"], "num_workers", "one rollout worker in each of the 1 training rank"),
        (
            [
                "trainer.n_gpus_per_node=2",
                "actor_rollout_ref.actor.strategy=fsdp2",
                "actor_rollout_ref.rollout.agent.num_workers=2",
            ],
            "actor.strategy",
            "fsdp2 ranks hold shards",
        ),
    ],
)
def test_hybrid_engine_true_is_refused_where_it_cannot_run(overrides, key, reason):
    from omni_core.validation.trainer_modes import trainer_mode_problems

    problems = trainer_mode_problems(_config("actor_rollout_ref.hybrid_engine=true", *overrides))
    assert [p.key for p in problems] == ["actor_rollout_ref.hybrid_engine"], problems
    assert key in problems[0].message and reason in problems[0].message
    assert "set actor_rollout_ref.hybrid_engine=false" in problems[0].message
    assert trainer_mode_problems(_config("actor_rollout_ref.hybrid_engine=false", *overrides)) == []


def test_hybrid_plan_gives_each_rank_its_whole_device_and_reserves_no_rollout_workers():
    from omni_core.resources import resource_plan, run_resource_budget

    two = [
        "trainer.device=cuda",
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.strategy=ddp",
        "actor_rollout_ref.rollout.agent.num_workers=2",
    ]
    hybrid, separate = _config(*two), _config(*two, "actor_rollout_ref.hybrid_engine=false")
    assert resource_plan(hybrid).rollout == ()
    assert [(s.bundle, s.num_gpus) for s in resource_plan(hybrid).training] == [(0, 1.0), (1, 1.0)]
    assert [(s.bundle, s.num_gpus) for s in resource_plan(separate).rollout] == [(0, 0.5), (1, 0.5)]
    assert run_resource_budget(hybrid).cpus["rollout_workers"] == 0
    assert run_resource_budget(separate).cpus["rollout_workers"] == 2
    assert run_resource_budget(hybrid).gpus == run_resource_budget(separate).gpus == 2


# ------------------------------------------------------------------------------------ the rollout itself
@pytest.fixture(scope="module")
def embeddings(tiny_sd3_dir, tmp_path_factory) -> str:
    from omni_core.models.prompt_embeddings import encode_prompt_set

    cfg = _rollout_config(tiny_sd3_dir, "float32")
    max_len = cfg.actor_rollout_ref.rollout.pipeline.max_sequence_length
    return str(encode_prompt_set(tiny_sd3_dir, PROMPTS, max_len, tmp_path_factory.mktemp("emb") / "prompts.safetensors"))


def _rollout_config(model_dir, rollout_dtype: str):
    return _config(
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.rollout.dtype={rollout_dtype}",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.pipeline.height=32",
        "actor_rollout_ref.rollout.pipeline.width=32",
        "actor_rollout_ref.rollout.pipeline.num_inference_steps=4",
        "actor_rollout_ref.rollout.pipeline.max_sequence_length=32",
        "actor_rollout_ref.rollout.algo.sde_window_range=[0,3]",
        "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=0.01",  # a step that moves the bf16 rollout's samples
    )


def _sample(manager, partition: str, params, step: int) -> dict[str, object]:
    """One step's request for PROMPTS through `manager`'s worker into the real TransferQueue; its rows by key."""
    from omni_core.data.prompts import PromptRecord
    from omni_core.rollout.request import RolloutRequest
    from omni_core.tq import client as tqc
    from omni_core.tq.replay_buffer import ReplayBuffer

    records = [PromptRecord(prompt=p, index=i) for i, p in enumerate(PROMPTS)]
    request = RolloutRequest.of_records(partition, step, params, records, uid_prefix=f"{step:06d}")
    tqc.put_prompts(partition, request.uids, step)
    manager.wait_for(manager.generate_sequences(request), 600)
    batch = ReplayBuffer(partition, poll_interval=0.05, timeout_s=600, liveness_check=manager.check_alive).sample(
        len(PROMPTS), step, params.n
    )
    assert not batch.failed_uids, batch.failed_uids
    return {"keys": batch.trajectory_keys, **tqc.get_trajectories(partition, batch.trajectory_keys)}


def _assert_same_rows(a: dict[str, object], b: dict[str, object], what: str) -> None:
    assert a.keys() == b.keys(), what
    for column, value in a.items():
        same = torch.equal(value, b[column]) if isinstance(value, torch.Tensor) else value == b[column]
        assert same, f"{what}: column {column} differs"


@pytest.mark.parametrize("rollout_dtype", ["float32", "bfloat16"])
def test_a_training_rank_samples_what_a_rollout_worker_with_its_weights_samples(
    ray_cluster, transfer_queue, tiny_sd3_dir, embeddings, rollout_dtype
):
    """float32: the rank samples with its trained modules (a view); bfloat16: with a bf16 copy it refreshes after the
    update. Before and after one real training step, the rows equal a separate RolloutWorker's given the same weights."""
    from omni_core.agent_loop import ROLLOUT_WORKER_THREADS, AgentLoopManager
    from omni_core.models.placement import rollout_shares_trained_weights
    from omni_core.records import WorkerNames
    from omni_core.rollout.sampling_params import SamplingParams
    from omni_core.tq import client as tqc
    from omni_core.workers.training_actor import TrainingActor

    cfg = _rollout_config(tiny_sd3_dir, rollout_dtype)
    assert rollout_shares_trained_weights(cfg, embeddings) is (rollout_dtype == "float32")
    run_id = f"hybrid-{rollout_dtype}-{uuid.uuid4().hex[:6]}"
    names = WorkerNames(namespace="omniflow-tests", run_id=run_id)
    config = cfg.model_dump(mode="json")
    threads = ROLLOUT_WORKER_THREADS
    rank = (
        ray_cluster.remote(TrainingActor)
        .options(num_cpus=1, name=names.training_rank(0), namespace=names.namespace)
        .remote(config, 4, threads, rollout_threads=threads, prompt_embeddings=embeddings)
    )
    hybrid = AgentLoopManager.in_training_ranks([rank], names)
    separate = AgentLoopManager.start(config, names, [{"num_cpus": 1}], threads, embeddings)
    hybrid.wait_ready()
    separate.wait_ready()
    params = SamplingParams.for_training(cfg.actor_rollout_ref.rollout)
    partitions = [f"{run_id}/{side}" for side in ("hybrid", "separate")]
    try:
        base = ray_cluster.get(rank.get_weights.remote())
        before = [_sample(m, p, params, 1) for m, p in zip((hybrid, separate), partitions, strict=True)]
        _assert_same_rows(*before, "base weights")

        advantages = torch.linspace(-1.0, 1.0, len(before[0]["keys"]))
        metrics = ray_cluster.get(rank.train_step.remote(partitions[0], before[0]["keys"], advantages, 1))
        assert metrics["actor/grad_norm"] > 0
        trained = ray_cluster.get(rank.get_weights.remote())
        assert any(not torch.equal(base[k], trained[k]) for k in base), "the update changed no weight"
        separate.update_weights(trained, 1)  # what the trainer pushes to a separate worker; the rank uses its own

        after = [_sample(m, p, params, 2) for m, p in zip((hybrid, separate), partitions, strict=True)]
        _assert_same_rows(*after, "after one update")
        # The update reached the samples (same seeds as step 2 with the base weights would differ).
        separate.update_weights(base, 0)
        stale = _sample(separate, f"{run_id}/stale", params, 2)
        assert not torch.equal(stale["latents"], after[0]["latents"])
    finally:
        separate.close()
        ray_cluster.kill(rank, no_restart=True)
        for partition in (*partitions, f"{run_id}/stale"):
            tqc.clear_partition(partition)
