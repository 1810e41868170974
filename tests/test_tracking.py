"""Tracking backends (`trainer.logger`) and the verl-omni data metrics."""

from __future__ import annotations

import io

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


STEP_1 = {"critic/rewards/mean": -0.5, "actor/pg_loss": 0.25, "bad": float("nan")}
STEP_2 = {"critic/rewards/mean": -0.25}


def _log_two_steps(backends: list[str], log_dir, stream=None) -> Tracking:
    tracking = Tracking(backends, log_dir, total_steps=2, stream=stream)
    tracking.log(STEP_1, step=1)
    tracking.log(STEP_2, step=2)
    tracking.close()
    return tracking


def test_console_backend_prints_a_progress_line_per_step_and_writes_no_file(tmp_path):
    stream = io.StringIO()
    _log_two_steps(["console"], tmp_path / "logs", stream)
    # 1 of 2 steps: 10 of 20 bar cells; NaN ("bad") is dropped, values in %.4g.
    assert stream.getvalue().splitlines() == [
        "[##########..........] step 1/2 rewards/mean=-0.5 pg_loss=0.25",
        "[####################] step 2/2 rewards/mean=-0.25",
    ]
    assert not (tmp_path / "logs").exists()


def test_file_backend_writes_one_jsonl_record_per_step_without_nan(tmp_path):
    tracking = _log_two_steps(["file"], tmp_path)
    assert tracking.jsonl_path == tmp_path / "metrics.jsonl"
    assert read_jsonl(tracking.jsonl_path) == [
        {"step": 1, "critic/rewards/mean": -0.5, "actor/pg_loss": 0.25},
        {"step": 2, "critic/rewards/mean": -0.25},
    ]
    assert not (tmp_path / "tensorboard").exists()


def test_tensorboard_backend_writes_scalars_readable_by_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log_two_steps(["tensorboard"], tmp_path)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["actor/pg_loss", "critic/rewards/mean"]
    assert [(e.step, e.value) for e in events.Scalars("critic/rewards/mean")] == [(1, -0.5), (2, -0.25)]
    assert [(e.step, e.value) for e in events.Scalars("actor/pg_loss")] == [(1, 0.25)]
    assert not (tmp_path / "metrics.jsonl").exists()
