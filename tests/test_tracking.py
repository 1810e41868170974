"""Tracking backends (`trainer.logger`) and the verl-omni data metrics."""

from __future__ import annotations

import io
import json
import struct

import numpy as np
import pytest
import torch
from PIL import Image

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


# ------------------------------------------------------------------------------------ validation images
def _two_images() -> tuple[torch.Tensor, list[str]]:
    """Two 8x6 uint8 images with known pixels: a red-to-black ramp and a solid colour."""
    ramp = torch.zeros(3, 8, 6, dtype=torch.uint8)
    ramp[0] = torch.arange(8, dtype=torch.uint8).mul(30).unsqueeze(1).expand(8, 6)
    solid = torch.tensor([10, 200, 40], dtype=torch.uint8).view(3, 1, 1).expand(3, 8, 6).clone()
    return torch.stack([ramp, solid]), ["a red ramp", "a green square"]


def test_file_backend_writes_pngs_and_an_index_of_paths_and_captions(tmp_path):
    images, captions = _two_images()
    tracking = Tracking(["file"], tmp_path, total_steps=4)
    tracking.log_images(3, images, captions)
    tracking.close()
    assert sorted(p.name for p in (tmp_path / "val_generations").iterdir()) == ["step_3_0.png", "step_3_1.png"]
    for i in range(2):  # PNG is lossless: the pixels come back exactly
        back = np.asarray(Image.open(tmp_path / "val_generations" / f"step_3_{i}.png"))
        assert back.shape == (8, 6, 3) and (back == images[i].permute(1, 2, 0).numpy()).all()
    assert read_jsonl(tmp_path / "val_generations.jsonl") == [
        {
            "step": 3,
            "images": [
                {"path": "val_generations/step_3_0.png", "caption": "a red ramp"},
                {"path": "val_generations/step_3_1.png", "caption": "a green square"},
            ],
        }
    ]
    assert not (tmp_path / "metrics.jsonl").exists()  # the metrics file stays numbers only


def test_tensorboard_backend_writes_images_and_captions_readable_by_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    images, captions = _two_images()
    tracking = Tracking(["tensorboard"], tmp_path, total_steps=4)
    tracking.log_images(2, images, captions)
    tracking.log_images(4, images[:1], captions[:1])
    tracking.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    assert sorted(events.Tags()["images"]) == ["val/generations/0", "val/generations/1"]
    first = events.Images("val/generations/0")
    assert [(e.step, e.width, e.height) for e in first] == [(2, 6, 8), (4, 6, 8)]
    decoded = np.asarray(Image.open(io.BytesIO(events.Images("val/generations/1")[0].encoded_image_string)).convert("RGB"))
    assert (decoded == images[1].permute(1, 2, 0).numpy()).all()
    text_tags = [t for t in events.Tags()["tensors"] if t.startswith("val/generations/1/caption")]
    assert len(text_tags) == 1
    caption = events.Tensors(text_tags[0])[0].tensor_proto.string_val[0].decode()
    assert caption == "a green square"
    assert not (tmp_path / "val_generations").exists()


def test_console_backend_says_where_the_images_went(tmp_path):
    images, captions = _two_images()
    lines: list[str] = []
    Tracking(["console"], tmp_path / "a", total_steps=4, console_sink=lines.append).log_images(1, images, captions)
    Tracking(["console", "file"], tmp_path / "b", total_steps=4, console_sink=lines.append).log_images(1, images, captions)
    assert lines == [
        "step 1: 2 validation image(s) -> not stored (add file, tensorboard or wandb to trainer.logger)",
        f"step 1: 2 validation image(s) -> {tmp_path / 'b' / 'val_generations'}",
    ]


def test_log_images_refuses_what_is_not_uint8_chw_with_one_caption_each(tmp_path):
    tracking = Tracking(["file"], tmp_path, total_steps=1)
    images, captions = _two_images()
    with pytest.raises(ValueError, match=r"uint8 images \[N, 3, H, W\]"):
        tracking.log_images(1, images.float(), captions)
    with pytest.raises(ValueError, match="2 images but 1 captions"):
        tracking.log_images(1, images, captions[:1])


# ------------------------------------------------------------------------------------------------ wandb
@pytest.fixture
def wandb_offline_env(tmp_path, monkeypatch):
    """No API key, no ~/.netrc, no WANDB_MODE: what a laptop without `wandb login` has (wandb's own files in tmp)."""
    for key in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_DIR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    (tmp_path / "home").mkdir()


def _wandb_records(path) -> list[bytes]:
    """The records of a `.wandb` transaction log, read independently of wandb (whose Python reader is gone since
    wandb-core): a 7-byte header (`:W&B`, magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each with a
    7-byte header (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last); a block's tail too short for a
    header is padding."""
    data, block = path.read_bytes(), 32768
    assert data[:7] == b":W&B" + struct.pack("<HB", 0xBEE1, 0), data[:7]
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # zeroed tail of the last block
            break
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(pending)
    return records


def _wandb_history(run_dir) -> list[dict]:
    """The history rows of an offline wandb run (its `run-<id>.wandb` log), parsed with wandb's protobuf schema."""
    from wandb.proto import wandb_internal_pb2

    (log,) = run_dir.glob("*.wandb")
    rows = []
    for data in _wandb_records(log):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows


def test_wandb_without_an_api_key_logs_offline_one_run_per_checkpoint_folder(tmp_path, wandb_offline_env):
    """Two epochs (two Tracking objects, as two fit_epoch tasks) of one checkpoint folder: offline runs under the log
    folder, both with the folder's run id, whose history holds every step's finite metrics and the images."""
    from omni_core.tracking import WandbRun, wandb_mode, wandb_run_id

    assert wandb_mode() == "offline"
    run_id = wandb_run_id("omniflow", "tiny sd3/jpeg", tmp_path / "ckpt")
    assert run_id == wandb_run_id("omniflow", "tiny sd3/jpeg", tmp_path / "ckpt" / ".." / "ckpt")  # same folder
    assert run_id != wandb_run_id("omniflow", "tiny sd3/jpeg", tmp_path / "other")
    assert run_id.startswith("tiny-sd3-jpeg-")
    run = WandbRun("omniflow", "tiny sd3/jpeg", run_id, {"data": {"train_batch_size": 2}})
    log_dir = tmp_path / "logs"
    for step, metrics in ((1, STEP_1), (2, STEP_2)):
        tracking = Tracking(["wandb"], log_dir, total_steps=2, wandb_run=run)
        tracking.log(metrics, step=step)
        if step == 2:
            tracking.log_images(2, torch.zeros(1, 3, 8, 8, dtype=torch.uint8), ["a red circle"])
        tracking.close()

    # One offline run per epoch (wandb adds "-1" to a folder name taken in the same second), in order.
    runs = sorted((log_dir / "wandb").glob(f"offline-run-*-{run_id}*"))
    assert len(runs) == 2, list((log_dir / "wandb").iterdir())
    first, second = (_wandb_history(r) for r in runs)
    assert [(row["_step"], row["critic/rewards/mean"], row["actor/pg_loss"]) for row in first] == [(1, -0.5, 0.25)]
    assert "bad" not in first[0]  # NaN is not logged
    assert [row["_step"] for row in second] == [2]
    assert second[0]["critic/rewards/mean"] == -0.25
    assert second[0]["val/generations/_type"] == "images/separated"
    assert second[0]["val/generations/captions"] == ["a red circle"]
    (png,) = second[0]["val/generations/filenames"]
    assert (runs[1] / "files" / png).is_file()


def test_wandb_mode_follows_the_api_key_and_wandb_mode(tmp_path, wandb_offline_env, monkeypatch):
    from omni_core.tracking import wandb_mode

    (tmp_path / "home" / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password 0123456789\n")
    (tmp_path / "home" / ".netrc").chmod(0o600)
    assert wandb_mode() == "online"  # `wandb login` wrote the key
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() is None  # wandb.init reads WANDB_MODE itself
