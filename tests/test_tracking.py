"""Tracking backends (`trainer.logger`) and the verl-omni data metrics."""

from __future__ import annotations

import io
import json
import re
import struct
from pathlib import Path

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
        "step 1: 2 validation image(s) -> not stored (add file, tensorboard, wandb or mlflow to trainer.logger)",
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


def test_wandb_without_an_api_key_logs_offline_one_run_per_checkpoint_folder(tmp_path, wandb_offline_env, capfd):
    """Two epochs (two Tracking objects, as two fit_epoch tasks) of one checkpoint folder: offline runs under the log
    folder, both with the folder's run id, whose history holds every step's finite metrics and the images. wandb
    prints nothing itself; the console gets one line, when the run starts, saying where it is."""
    from omni_core.tracking import TrackerRun, tracker_run_id, wandb_mode

    assert wandb_mode() == "offline"
    run_id = tracker_run_id("omniflow", "tiny sd3/jpeg", tmp_path / "ckpt")
    assert run_id == tracker_run_id("omniflow", "tiny sd3/jpeg", tmp_path / "ckpt" / ".." / "ckpt")  # same folder
    assert run_id != tracker_run_id("omniflow", "tiny sd3/jpeg", tmp_path / "other")
    assert run_id.startswith("tiny-sd3-jpeg-")
    run = TrackerRun("omniflow", "tiny sd3/jpeg", run_id, {"data": {"train_batch_size": 2}})
    log_dir, lines = tmp_path / "logs", []
    for step, metrics in ((1, STEP_1), (2, STEP_2)):
        tracking = Tracking(
            ["console", "wandb"], log_dir, total_steps=2, console_sink=lines.append, resume_step=step - 1, run=run
        )
        tracking.log(metrics, step=step)
        if step == 2:
            tracking.log_images(2, torch.zeros(1, 3, 8, 8, dtype=torch.uint8), ["a red circle"])
        tracking.close()
    out, err = capfd.readouterr()
    assert "wandb" not in out + err  # no banner (offline mode, run folder, `wandb leet`), three lines per epoch before
    sync = f"`wandb sync {log_dir / 'wandb'}/offline-run-*-{run_id}*` uploads it"
    assert lines[0] == f"tracking: wandb run {run_id} offline in {log_dir / 'wandb'} ({sync})"
    assert lines[1:] == [
        "[##########..........] step 1/2 rewards/mean=-0.5 pg_loss=0.25",  # the second epoch (resume_step 1) says nothing
        "[####################] step 2/2 rewards/mean=-0.25",
        f"step 2: 1 validation image(s) -> wandb run {run_id} (val/generations)",
    ]

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


# ----------------------------------------------------------------------------------------------- mlflow
def _mlflow_client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def _png_pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


def test_mlflow_store_is_the_checkpoint_folder_unless_mlflow_tracking_uri_is_set(tmp_path, monkeypatch):
    from omni_core.trackers.mlflow_run import metric_name, mlflow_tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert mlflow_tracking_uri(tmp_path / "ckpt") == f"sqlite:///{tmp_path}/ckpt/mlruns/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert mlflow_tracking_uri(tmp_path / "ckpt") == "http://127.0.0.1:5000"  # a server (or any store) wins, as in verl
    # mlflow refuses `@` in names: verl-omni's validation keys are written as verl writes them to mlflow.
    assert metric_name("val-core/ocr/reward/mean@4") == "val-core/ocr/reward/mean_at_4"


def test_mlflow_logs_params_metrics_images_and_the_model_to_one_run_per_checkpoint_folder(tmp_path, monkeypatch):
    """Epoch 1, a first try of epoch 2 that fails after logging step 2, and its retry (three Tracking objects, as
    three fit_epoch tasks) of one checkpoint folder: one mlflow run in the folder's store, read back with mlflow's
    own client: the flattened config as params, each step's metrics once (the failed try's value of step 2 stays),
    the images with their pixels and captions, and the final model's files."""
    from omni_core.tracking import TrackerRun, tracker_run_id

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ckpt, log_dir = tmp_path / "ckpt", tmp_path / "logs"
    config = {"data": {"train_batch_size": 2, "val_files": None}, "trainer": {"logger": ["console", "mlflow"], "total_epochs": 2}}
    run = TrackerRun("omniflow", "tiny sd3/jpeg", tracker_run_id("omniflow", "tiny sd3/jpeg", ckpt), config, ckpt)
    images, captions = _two_images()
    model = ckpt / "global_step_2" / "actor" / "hf"
    (model / "transformer").mkdir(parents=True)
    (model / "config.json").write_text('{"num_layers": 2}')
    (model / "transformer" / "weights.bin").write_bytes(bytes(range(256)) * 4)
    lines: list[str] = []

    def epoch(resume_step: int, run: TrackerRun = run) -> Tracking:
        return Tracking(
            ["console", "mlflow"], log_dir, total_steps=2, console_sink=lines.append, resume_step=resume_step, run=run
        )

    first = epoch(0)
    first.log({**STEP_1, "val-core/ocr/reward/mean@4": 0.75}, step=1)
    first.log_images(1, images, captions)
    first.close()
    failed = epoch(1)
    failed.log(STEP_2, step=2)
    failed.close(failed=True)
    changed = TrackerRun(run.project, run.name, run.run_id, {**config, "trainer": {**config["trainer"], "total_epochs": 3}}, ckpt)
    retry = epoch(1, changed)
    retry.log({"critic/rewards/mean": 99.0, "actor/pg_loss": 0.5}, step=2)  # step 2 of critic/rewards/mean is there
    retry.log_images(2, images[:1], captions[:1])
    retry.log_model(ckpt / "global_step_2", step=2)
    retry.close()
    run_id = first.mlflow_run_id
    assert failed.mlflow_run_id == retry.mlflow_run_id == run_id

    uri = f"sqlite:///{ckpt}/mlruns/mlflow.db"
    client = _mlflow_client(uri)
    experiment = client.get_experiment_by_name("omniflow")
    (stored,) = client.search_runs([experiment.experiment_id])
    assert stored.info.run_id == run_id and stored.info.run_name == "tiny sd3/jpeg" and stored.info.status == "FINISHED"
    assert stored.data.tags["omniflow.run_id"] == run.run_id and stored.data.tags["omniflow.model_step"] == "2"
    assert stored.data.params == {
        "data.train_batch_size": "2",
        "data.val_files": "null",
        "trainer.logger": '["console", "mlflow"]',
        "trainer.total_epochs": "2",  # mlflow params are fixed: the first value stays, the change is said
    }
    assert _history(client, run_id, "critic/rewards/mean") == [(1, -0.5), (2, -0.25)]
    assert _history(client, run_id, "actor/pg_loss") == [(1, 0.25), (2, 0.5)]
    assert _history(client, run_id, "val-core/ocr/reward/mean_at_4") == [(1, 0.75)]
    assert "bad" not in stored.data.metrics  # NaN is not logged

    # Artifacts, in the store's folder next to the database: images (PNG, lossless), captions, the model.
    artifacts = Path(stored.info.artifact_uri.removeprefix("file://"))
    assert artifacts.is_relative_to(ckpt / "mlruns" / "artifacts")
    pngs = sorted(p.name for p in (artifacts / "images").glob("*.png"))
    assert [(n.split("+")[0], n.split("+")[2]) for n in pngs] == [
        ("val~generations~0", "1"),
        ("val~generations~0", "2"),
        ("val~generations~1", "1"),
    ]
    (second_of_step_1,) = (artifacts / "images").glob("val~generations~1+step+1+*[0-9a-f].png")
    assert (_png_pixels(second_of_step_1) == images[1].permute(1, 2, 0).numpy()).all()
    assert json.loads((artifacts / "val_generations" / "step_1.json").read_text()) == {
        "step": 1,
        "images": [
            {"key": "val/generations/0", "caption": "a red ramp"},
            {"key": "val/generations/1", "caption": "a green square"},
        ],
    }
    listed = {a.path for a in client.list_artifacts(run_id, "model")}
    assert listed == {"model/config.json", "model/transformer"}
    assert (artifacts / "model" / "transformer" / "weights.bin").read_bytes() == bytes(range(256)) * 4

    assert lines[0] == f"tracking: mlflow run {run_id} in {uri}"
    assert "mlflow run " + run_id + " keeps the first value of changed params: trainer.total_epochs (2 -> 3)" in lines
    assert lines[-1] == f"final model (step 2) -> mlflow run {run_id} artifact model/"
    assert sum(line.startswith("tracking:") for line in lines) == 1  # said when the run starts, not every epoch


def test_a_verl_omni_recipe_logger_line_validates_with_wandb_and_mlflow(tiny_sd3_dir):
    """`trainer.logger=["console", "wandb"]` exactly as verl-omni's recipes write it, and with mlflow."""
    from omni_core.validation import prepare_run_config

    recipe = Path(__file__).parent / "data" / "verl_omni_recipes" / "run_sd35_medium_ocr_lora_v1.txt"
    (line,) = [x for x in recipe.read_text().splitlines() if x.startswith("trainer.logger=")]
    model = f"actor_rollout_ref.model.path={tiny_sd3_dir}"
    assert prepare_run_config(None, [model, line]).trainer.logger == ("console", "wandb")
    assert prepare_run_config(None, [model, "trainer.logger=[console,mlflow]"]).trainer.logger == ("console", "mlflow")


# ------------------------------------------------------------------------------------------ a whole run
def test_a_flow_run_logs_to_wandb_mlflow_and_tensorboard_what_the_file_backend_holds(
    prefect_api, ray_cluster, transfer_queue, flow_overrides, tmp_path, capfd
):
    import time

    from omniflow.flows.main_diffusion_v1 import main_diffusion_v1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ckpt = tmp_path / "ckpt"
    overrides = ["trainer.total_epochs=1", "trainer.log_val_generations=1", f"trainer.default_local_dir={ckpt}"]
    state = main_diffusion_v1(
        overrides=[*flow_overrides, *overrides, "trainer.logger=[console,file,wandb,mlflow,tensorboard]"], return_state=True
    )
    assert state.is_completed(), state.message
    result = state.result()
    log_dir = Path(result.log_dir)
    rows = {r.pop("step"): r for r in read_jsonl(log_dir / "metrics.jsonl")}
    assert sorted(rows) == [0, 1] and "critic/rewards/mean" in rows[1]  # validation before training, the one step
    assert any(k.startswith("val-core/") for k in rows[0])
    (val_png,) = (log_dir / "val_generations").glob("step_0_0.png")  # log_val_generations=1: one image, at step 0
    val_pixels = _png_pixels(val_png)

    # wandb: one offline run (no API key; the tests set WANDB_MODE=offline), the same numbers and image.
    (wandb_dir,) = (log_dir / "wandb").glob("offline-run-*")
    history = {row["_step"]: row for row in _wandb_history(wandb_dir)}
    assert sorted(history) == [0, 1]
    assert all(history[step][k] == v for step, row in rows.items() for k, v in row.items())
    (wandb_png,) = history[0]["val/generations/filenames"]
    assert (_png_pixels(wandb_dir / "files" / wandb_png) == val_pixels).all()

    # TensorBoard: every scalar (stored as float32) and the image.
    events = EventAccumulator(str(log_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    for step, row in rows.items():
        for k, v in row.items():
            assert [np.float32(e.value) for e in events.Scalars(k) if e.step == step] == [np.float32(v)], k
    (tb_image,) = events.Images("val/generations/0")
    assert tb_image.step == 0
    assert (np.asarray(Image.open(io.BytesIO(tb_image.encoded_image_string)).convert("RGB")) == val_pixels).all()

    # mlflow: the default store in the checkpoint folder, the same numbers (`@` written `_at_`), the image, the model.
    client = _mlflow_client(f"sqlite:///{ckpt}/mlruns/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("omniflow").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["trainer.total_epochs"] == "1"
    for step, row in rows.items():
        for k, v in row.items():
            assert [m.value for m in client.get_metric_history(run.info.run_id, k.replace("@", "_at_")) if m.step == step] == [
                v
            ], k
    artifacts = Path(run.info.artifact_uri.removeprefix("file://"))
    (mlflow_png,) = (artifacts / "images").glob("val~generations~0+step+0+*[0-9a-f].png")
    assert (_png_pixels(mlflow_png) == val_pixels).all()
    model = Path(result.final_checkpoint) / "actor" / "hf"
    files = sorted(p.relative_to(model) for p in model.rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(artifacts / "model") for p in (artifacts / "model").rglob("*") if p.is_file())
    assert all((model / f).read_bytes() == (artifacts / "model" / f).read_bytes() for f in files)

    # The console: Ray forwards the epoch worker's stderr to this process in order; once the task's last line is
    # here, wandb's banner (offline mode, run folder, `wandb leet`) would be too. Only OmniFlow's one line about it.
    console, deadline = "", time.monotonic() + 60
    while "Task run 'fit_epoch-0' - Finished in state" not in console and time.monotonic() < deadline:
        console += "".join(capfd.readouterr())
        time.sleep(0.2)
    assert "Task run 'fit_epoch-0' - Finished in state" in console
    assert "- tracking: wandb run " in console
    plain = re.sub(r"\x1b\[[0-9;]*m", "", console)  # Ray colours its `(fit_epoch pid=N)` prefix
    noise = [line for line in plain.splitlines() if re.search(r"(^|\) )wandb: ", line)]  # wandb's own prefix
    assert not noise, noise


def test_an_mlflow_folder_store_that_mlflow_refuses_is_refused_before_the_run(tmp_path, monkeypatch, tiny_sd3_dir):
    from omni_core.config import ConfigError
    from omni_core.validation import prepare_run_config

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path}/mlruns")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    overrides = [f"actor_rollout_ref.model.path={tiny_sd3_dir}", "trainer.logger=[console,mlflow]"]
    with pytest.raises(ConfigError) as err:
        prepare_run_config(None, overrides)
    (problem,) = err.value.problems
    assert problem.key == "trainer.logger" and "MLFLOW_ALLOW_FILE_STORE=true" in problem.message, str(problem)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow's own opt-in: then the folder store is used
    assert prepare_run_config(None, overrides).trainer.logger == ("console", "mlflow")
