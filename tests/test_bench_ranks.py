"""Smoke test of benchmarks/bench_ranks.py: its two measurements on the session's Ray cluster, on a small workload.

The byte counts are checked against the tiny transformer counted here: two ranks all-reduce every trainable
parameter once per optimizer step (fp32), and a weight sync sends the whole transformer state dict.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.bench  # a benchmark script: `make test-bench` (CI runs it)

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# 32 px and 4 steps instead of 64 px and 10: the same 2 prompts x 8 samples (one mini-batch of 16), faster.
SMALL = [
    "actor_rollout_ref.rollout.pipeline.height=32",
    "actor_rollout_ref.rollout.pipeline.width=32",
    "actor_rollout_ref.rollout.pipeline.num_inference_steps=4",
    "actor_rollout_ref.rollout.algo.sde_window_range=[0,3]",
]


@pytest.fixture(scope="module")
def bench_ranks(ray_cluster):
    """The benchmark as a module; its actor classes travel to Ray workers by value (benchmarks/ is no package)."""
    sys.path.insert(0, str(BENCHMARKS))
    import bench_ranks

    ray_cluster.cloudpickle.register_pickle_by_value(bench_ranks)
    yield bench_ranks
    ray_cluster.cloudpickle.unregister_pickle_by_value(bench_ranks)
    sys.path.remove(str(BENCHMARKS))


def _transformer(tiny_sd3_dir):
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel.from_pretrained(Path(tiny_sd3_dir) / "transformer")


def test_two_ranks_all_reduce_every_gradient_once_per_step(bench_ranks, ray_cluster, tiny_sd3_dir):
    traj, advantages = bench_ranks.rollout_once(bench_ranks.rank_config(tiny_sd3_dir, 1, "cpu", SMALL))
    entry = bench_ranks.bench_ranks(tiny_sd3_dir, 2, 1, ray_cluster.put(traj), advantages, 1, "cpu", SMALL)

    params = sum(p.numel() for p in _transformer(tiny_sd3_dir).parameters())  # 2,292,544
    allreduce = entry["allreduce"]
    # One mini-batch of 16 = one optimizer step per training step: each fp32 gradient all-reduced once.
    assert allreduce["bytes_per_step_per_warmup_and_repeat"] == [4 * params, 4 * params]
    assert allreduce["ring_bytes_sent_per_rank_per_step"] == 4 * params  # 2 (N-1)/N x payload, N = 2
    assert entry["samples_per_rank"] == 8 and entry["first_ratio_mean_per_rank"] == [1.0, 1.0]
    assert entry["backend"] == "gloo" and allreduce["isolated_s"]["median_s"] > 0
    assert entry["samples_per_s"] == pytest.approx(16 / entry["update_s"]["median_s"])


def test_weight_sync_sends_the_whole_transformer_state(bench_ranks, ray_cluster, tiny_sd3_dir):
    entry = bench_ranks.bench_weight_sync(Path(tiny_sd3_dir), 1, "cpu")

    state = _transformer(tiny_sd3_dir).state_dict()
    assert entry["bytes"] == entry["state_bytes"] == sum(t.numel() * t.element_size() for t in state.values())
    assert all(t.dtype == torch.float32 for t in state.values())
    for k in (1, 2):
        sync = entry[f"receivers_{k}"]
        assert sync["total_s"]["median_s"] >= sync["get_weights_s"]["median_s"] > 0
        assert sync["delivered_mb_per_s"] == pytest.approx(k * sync["mb_per_s"])
