"""Rollout results do not depend on the rollout-worker layout (`actor_rollout_ref.rollout.agent.num_workers`).

Per-sample seeds come from (seed, step, prompt index, sample index), each worker samples one prompt group per
batch (`omni_core.rollout.sampler.generate_groups`) and runs on the same number of torch threads whatever the
worker count (`omni_core.agent_loop.ROLLOUT_WORKER_THREADS`), so the same step request gives the same
trajectory rows bit for bit from one worker, from two, or in `data.gen_batch_size` chunks, and a run's final
weights do not depend on the worker count either.
"""

from __future__ import annotations

import re
import time
import uuid

import pytest
import torch

# The group: shares that session run with other modules (conftest).
pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("separate_workers_run")]

PROMPTS = ["a red circle", "a blue square", "a green dot"]
# 3 prompts x 2 samples: one worker samples 6 rows, two workers 2 + 4 rows. On the 2-core CPU this was
# written on, batches of 1-3 rows take other kernel paths than batches of 4 or more (velocity rows differed
# by up to 1.2e-6), so before per-group batches the 2-row worker's latents differed (max 4.8e-7).
SAMPLES_PER_PROMPT = 2
# The DEBUG line each rollout-worker call sends back with its result.
WORKER_LINE = re.compile(r"rollout worker (?P<worker>\d+): (?P<samples>\d+) samples for ")


@pytest.fixture(scope="module")
def rollout_setup(tiny_sd3_dir, tmp_path_factory):
    """The config of the rollout tests (as a Ray actor gets it) and the prompt-embedding file of their prompts."""
    from omni_core.config import load_config
    from omni_core.models.prompt_embeddings import encode_prompt_set

    cfg = load_config(
        overrides=[
            f"actor_rollout_ref.model.path={tiny_sd3_dir}",
            f"actor_rollout_ref.rollout.n={SAMPLES_PER_PROMPT}",
            "actor_rollout_ref.rollout.pipeline.height=32",
            "actor_rollout_ref.rollout.pipeline.width=32",
            "actor_rollout_ref.rollout.pipeline.num_inference_steps=4",
            "actor_rollout_ref.rollout.pipeline.max_sequence_length=32",
            "actor_rollout_ref.rollout.algo.sde_window_range=[0,3]",
        ]
    )
    max_len = cfg.actor_rollout_ref.rollout.pipeline.max_sequence_length
    embeddings = encode_prompt_set(tiny_sd3_dir, PROMPTS, max_len, tmp_path_factory.mktemp("emb") / "prompts.safetensors")
    return cfg, str(embeddings)


def test_generate_groups_samples_each_prompt_group_as_its_own_batch(rollout_setup, tiny_sd3_dir, one_torch_thread):
    """The rows of prompt i equal a call for prompt i alone, whatever prompts come with it: what makes a
    worker's rows independent of how the request was split."""
    from omni_core.models.placement import rollout_policy_kwargs
    from omni_core.models.policy import FlowPolicy
    from omni_core.rollout.sampler import generate, generate_groups
    from omni_core.rollout.sampling_params import SamplingParams

    cfg, embeddings = rollout_setup
    policy = FlowPolicy.from_model_config(cfg.actor_rollout_ref.model, **rollout_policy_kwargs(cfg, embeddings))
    kwargs = SamplingParams.for_training(cfg.actor_rollout_ref.rollout).generate_kwargs(global_step=3)
    together = generate_groups(policy, PROMPTS, prompt_indices=[0, 1, 2], **kwargs).to_columns()
    alone = [generate(policy, [p], prompt_indices=[i], **kwargs).to_columns() for i, p in enumerate(PROMPTS)]
    for column, value in together.items():
        assert torch.equal(value, torch.cat([a[column] for a in alone])), column
    with pytest.raises(ValueError, match="2 negative prompts for 3 prompts"):
        generate_groups(policy, PROMPTS, ["", ""], **kwargs)


def _samples_per_worker(manager, total: int, timeout_s: float = 120.0) -> dict[int, int]:
    """How many samples each worker reported (its DEBUG line), once they add up to `total` (bounded wait: a
    worker tags its prompts finished just before its call returns)."""
    counts: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    while sum(counts.values()) < total and time.monotonic() < deadline:
        for _, message in manager.drain_logs():
            found = WORKER_LINE.match(message)
            if found:
                counts[int(found["worker"])] = counts.get(int(found["worker"]), 0) + int(found["samples"])
        time.sleep(0.05)
    return counts


def _rollout(cfg, embeddings: str, num_workers: int, chunk_size: int | None) -> tuple[dict[str, object], dict[int, int]]:
    """One training step's request through `num_workers` real rollout workers into the real TransferQueue: the
    rows as the trainer reads them (sorted by key), and how many samples each worker made."""
    from omni_core.agent_loop import ROLLOUT_WORKER_THREADS, AgentLoopManager
    from omni_core.data.prompts import PromptRecord
    from omni_core.records import WorkerNames
    from omni_core.rollout.request import RolloutRequest
    from omni_core.rollout.sampling_params import SamplingParams
    from omni_core.tq import client as tqc
    from omni_core.tq.replay_buffer import ReplayBuffer

    run_id = f"layout-{num_workers}-{chunk_size}-{uuid.uuid4().hex[:6]}"
    names = WorkerNames(namespace="omniflow-tests", run_id=run_id)
    options = [{"num_cpus": 1}] * num_workers
    manager = AgentLoopManager.start(cfg.model_dump(mode="json"), names, options, ROLLOUT_WORKER_THREADS, embeddings)
    manager.wait_ready()
    partition = f"{run_id}/train"
    try:
        records = [PromptRecord(prompt=p, index=i) for i, p in enumerate(PROMPTS)]
        params = SamplingParams.for_training(cfg.actor_rollout_ref.rollout)
        request = RolloutRequest.of_records(partition, 3, params, records, uid_prefix="000003")
        tqc.put_prompts(partition, request.uids, request.global_step)
        manager.generate_sequences(request, chunk_size)
        buffer = ReplayBuffer(partition, poll_interval=0.05, timeout_s=600, liveness_check=manager.check_alive)
        batch = buffer.sample(len(PROMPTS), request.global_step, params.n)
        assert not batch.failed_uids, batch.failed_uids
        rows = tqc.get_trajectories(partition, batch.trajectory_keys)
        return rows, _samples_per_worker(manager, request.num_samples)
    finally:
        manager.close()
        tqc.clear_partition(partition)


def test_one_and_two_rollout_workers_write_identical_trajectories(ray_cluster, transfer_queue, rollout_setup):
    cfg, embeddings = rollout_setup
    layouts = {"1 worker": (1, None), "2 workers": (2, None), "2 workers, chunks of 2 prompts": (2, 2)}
    results = {name: _rollout(cfg, embeddings, *layout) for name, layout in layouts.items()}
    # The layouts really differ: who sampled how many rows (contiguous parts, or chunks dealt round-robin).
    assert {name: counts for name, (_, counts) in results.items()} == {
        "1 worker": {0: 6},
        "2 workers": {0: 2, 1: 4},
        "2 workers, chunks of 2 prompts": {0: 4, 1: 2},
    }
    reference, _ = results["1 worker"]
    assert {"latents", "log_probs", "images", "rewards", "cond.prompt_embeds", "cond.pooled_prompt_embeds"} <= set(reference)
    assert reference["latents"].shape[0] == len(PROMPTS) * SAMPLES_PER_PROMPT
    assert torch.isfinite(reference["log_probs"]).all() and torch.isfinite(reference["rewards"]).all()
    for name, (rows, _) in results.items():
        assert rows.keys() == reference.keys(), name
        for column, value in reference.items():
            other = rows[column]
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            assert same, f"{name}: column {column} differs from the 1-worker rollout"


def test_a_run_with_two_rollout_workers_ends_with_the_weights_of_the_hybrid_engine(
    flow_reference, flow_overrides, separate_workers_run, ray_cluster
):
    """The lean 2-epoch run again with two rollout workers (processes of their own; the shared run also has EMA
    validation and a killed worker, none of which may change training): bit-identical final weights to
    `flow_reference`, whose single rollout worker is its training actor (the hybrid engine, the default)."""
    from flow_utils import assert_same_weights, final_weights
    from ray.util.state import list_actors

    from omni_core.config import load_config

    assert load_config(overrides=flow_overrides).actor_rollout_ref.rollout.agent.num_workers == 1
    state, ckpt, _ = separate_workers_run
    assert state.is_completed(), state.message
    result = state.result()
    assert result.global_step == flow_reference[1].global_step == 2

    # Each run's rollout workers, from Ray's state API (dead actors are listed too).
    address = ray_cluster.get_runtime_context().gcs_address
    actors = [a.name for a in list_actors(address=address, filters=[("class_name", "=", "RolloutWorker")], limit=10_000)]
    workers = {
        run: sorted(n for n in actors if n.startswith(f"omniflow-{run}-")) for run in (flow_reference[1].run_id, result.run_id)
    }
    assert workers == {
        flow_reference[1].run_id: [],
        result.run_id: [f"omniflow-{result.run_id}-rollout-worker-{i}" for i in (0, 1)],
    }
    assert_same_weights(final_weights(ckpt), final_weights(flow_reference[2]))
    # The run's zero-std filter (conftest) went through the controller, the ranks and the update at every step: it
    # kept both groups (the jpeg reward never ties), so training is the reference's, bit for bit, as checked above.
    from omni_core.tracking import read_jsonl

    records = [r for r in read_jsonl(result.log_dir + "/metrics.jsonl") if "training/zero_std_filter/trained_groups" in r]
    assert [r["training/global_step"] for r in records] == [1.0, 2.0], records
    for record in records:
        assert (record["training/zero_std_filter/trained_groups"], record["training/zero_std_filter/dropped_groups"]) == (
            2.0,
            0.0,
        )
