"""Tracking backends (`trainer.logger`) and the verl-omni data metrics."""

from __future__ import annotations

import io

import pytest
import torch

from omni_core.tracking import Tracking, data_metrics, read_jsonl, timing_metrics


def test_data_metrics_by_hand():
    # Two groups: [1, 3] (mean 2) and [5, 5] (constant: zero std) -> zero_std_ratio 1/2.
    rewards = torch.tensor([1.0, 3.0, 5.0, 5.0])
    advantages = torch.tensor([-1.0, 1.0, 0.0, 0.0])
    m = data_metrics(rewards, advantages, torch.tensor([0, 0, 1, 1]))
    assert m["critic/rewards/mean"] == 3.5 and m["critic/rewards/max"] == 5.0 and m["critic/rewards/min"] == 1.0
    assert m["critic/advantages/max"] == 1.0 and m["critic/advantages/min"] == -1.0
    assert m["critic/rewards/zero_std_ratio"] == 0.5


def test_timing_metrics_throughput():
    m = timing_metrics({"gen": 1.0, "step": 4.0}, num_images=16)
    assert m["timing_s/gen"] == 1.0 and m["perf/throughput"] == 4.0  # 16 images / 4 s


def test_console_file_and_tensorboard_backends(tmp_path):
    pytest.importorskip("tensorboard")
    stream = io.StringIO()
    tracking = Tracking(["console", "file", "tensorboard"], tmp_path, total_steps=2, stream=stream)
    tracking.log({"critic/rewards/mean": -0.5, "actor/pg_loss": 0.25, "bad": float("nan")}, step=1)
    tracking.log({"critic/rewards/mean": -0.25}, step=2)
    tracking.close()
    assert "[##########..........] step 1/2 rewards/mean=-0.5 pg_loss=0.25" in stream.getvalue()
    records = read_jsonl(tracking.jsonl_path)
    assert records == [{"step": 1, "critic/rewards/mean": -0.5, "actor/pg_loss": 0.25}, {"step": 2, "critic/rewards/mean": -0.25}]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("critic/rewards/mean")] == [-0.5, -0.25]
