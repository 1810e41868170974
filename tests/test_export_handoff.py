"""The export as a hand-off: the base model's unchanged files hard-linked (copied across file systems), the trained
transformer as new files, a model card from the checkpoint's own records, the mlflow registry, and the Prefect asset.

The checkpoint is written the way a run writes one (`TrainingActor.save` into a `CheckpointWriter`, with the config
and the controller state naming the run), its transformer moved away from the base as training would, and the run's
metrics logged by the real `Tracking` file backend into `<root>/logs/<run id>/metrics.jsonl`.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import pytest
import torch

from omni_core.checkpoint import CheckpointWriter, read_tensors
from omni_core.checkpoint.layout import run_log_dir
from omni_core.config import load_config, to_yaml
from omni_core.export import export_checkpoint
from omni_core.tracking import Tracking

RUN_ID = "handoff-run-1"
STEP = 3
# What the run logged: step 2's training record, then step 3's training and validation records (merged in the card).
RECORDS = [
    (2, {"critic/rewards/mean": -0.0087654321, "actor/pg_loss": 0.25}),
    (3, {"critic/rewards/mean": -0.0081234567891, "actor/pg_loss": 0.125}),
    (3, {"val-core/jpeg_compressibility/reward/mean@1": -0.0079}),
]


def _write_run(root: Path, base: Path, logger: list[str]) -> Path:
    """`<root>/global_step_3` of a full fine-tuning run of `base` whose transformer moved, and the run's metrics."""
    from omni_core.workers.training_actor import TrainingActor

    threads = torch.get_num_threads()
    cfg = load_config(
        overrides=[
            f"actor_rollout_ref.model.path={base}",
            f"trainer.default_local_dir={root}",
            "trainer.experiment_name=handoff",
            f"trainer.logger=[{','.join(logger)}]",
        ]
    )
    actor = TrainingActor(cfg.model_dump(mode="json"), total_training_steps=STEP, num_threads=1)
    torch.set_num_threads(threads)
    with torch.no_grad():  # move the transformer away from the base, as training would
        gen = torch.Generator().manual_seed(0)
        for p in actor.policy.transformer.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)
    with CheckpointWriter(root, STEP) as writer:
        actor.save(str(writer.tmp))
        writer.write_config(to_yaml(cfg))
        writer.write_state("controller", {"global_step": STEP, "run_id": RUN_ID})
        ckpt = writer.commit()
    tracking = Tracking(["file"], run_log_dir(root, RUN_ID), STEP)
    for step, metrics in RECORDS:
        tracking.log(metrics, step=step)
    tracking.close()
    return ckpt


@pytest.fixture(scope="module")
def full_checkpoint(tiny_sd3_dir, tmp_path_factory) -> Path:
    return _write_run(tmp_path_factory.mktemp("handoff") / "run", Path(tiny_sd3_dir), ["console", "file"])


def _files(root: Path) -> dict[str, Path]:
    return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}


def _unchanged(base: Path) -> dict[str, Path]:
    """The base model's files that training does not change: all but the transformer's."""
    return {k: p for k, p in _files(base).items() if not k.startswith("transformer/")}


def _card_metrics(card: str) -> dict[str, float]:
    """The rows of the card's final-metrics table, parsed back."""
    table = card.split("## Final metrics")[1].split("##")[0]
    rows = [line.strip("|").split("|") for line in table.splitlines() if line.startswith("| ") and "metric" not in line]
    return {k.strip(): float(v) for k, v in rows}


def test_full_export_links_the_base_and_writes_the_trained_transformer_and_a_card(
    full_checkpoint, tiny_sd3_dir, tmp_path, one_torch_thread
):
    from diffusers import DiffusionPipeline
    from huggingface_hub import ModelCard

    base, out = Path(tiny_sd3_dir).resolve(), tmp_path / "export"
    info = export_checkpoint(base, full_checkpoint, out)
    unchanged = _unchanged(base)
    assert (info.kind, info.step, info.linked_files, info.copied_files) == ("full", STEP, len(unchanged), 0)
    for rel, src in unchanged.items():  # the same file, not a copy: one inode, two names at least
        got = (out / rel).stat()
        assert (got.st_ino, got.st_dev) == (src.stat().st_ino, src.stat().st_dev), rel
        assert got.st_nlink >= 2, rel
    transformer = {k: p for k, p in _files(out).items() if k.startswith("transformer/")}
    hf = full_checkpoint / "actor" / "hf"
    assert sorted(transformer) == sorted(f"transformer/{k}" for k in _files(hf))
    for rel, path in transformer.items():  # new files: neither the base's nor the checkpoint's
        assert path.stat().st_nlink == 1, rel
        assert path.read_bytes() == (hf / rel.removeprefix("transformer/")).read_bytes(), rel

    # It loads the production way and holds the trained weights; the rest is the base's.
    pipe = DiffusionPipeline.from_pretrained(out, local_files_only=True)
    trained, exported = read_tensors(full_checkpoint / "actor", "model"), pipe.transformer.state_dict()
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)
    base_sd = DiffusionPipeline.from_pretrained(base, local_files_only=True).transformer.state_dict()
    assert not all(torch.equal(base_sd[k], trained[k]) for k in trained)

    # The model card: diffusers front matter, the algorithm, the steps, the run's final metrics, the config.
    card = ModelCard.load(out / "README.md")
    assert (card.data.library_name, card.data.base_model) == ("diffusers", str(base))
    assert {"flow-grpo", "text-to-image"} <= set(card.data.tags)
    assert "| algorithm | flow_grpo (loss flow_grpo, advantages flow_grpo) |" in card.text
    assert f"| steps trained | {STEP} |" in card.text
    step_3 = {**RECORDS[1][1], **RECORDS[2][1]}  # both records of the checkpoint's step, none of step 2
    assert _card_metrics(card.text) == step_3
    assert "experiment_name: handoff" in card.text.split("## Training config")[1]

    # Editing the export's transformer cannot reach the base (nor the checkpoint): it is not linked.
    before = {k: p.read_bytes() for k, p in _files(base).items()}
    weights = out / "transformer" / "diffusion_pytorch_model.safetensors"
    with weights.open("r+b") as f:  # in place, the edit that would go through a hard link
        f.seek(-1, os.SEEK_END)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
        f.seek(0)
    assert {k: p.read_bytes() for k, p in _files(base).items()} == before
    assert (hf / "diffusion_pytorch_model.safetensors").read_bytes() != weights.read_bytes()


def test_an_export_never_writes_into_a_base_file_and_a_reexport_leaves_the_base_whole(full_checkpoint, tiny_sd3_dir, tmp_path):
    """A base with its own README.md and export_info.json (a Hub download has a card): the export writes its own,
    never through a link; replacing an earlier export unlinks its links and leaves the base's files as they were."""
    base = tmp_path / "base"
    shutil.copytree(tiny_sd3_dir, base)
    (base / "README.md").write_text("the base model's own card\n")
    (base / "export_info.json").write_text("{}\n")
    before = {k: p.read_bytes() for k, p in _files(base).items()}
    out = tmp_path / "export"
    for _ in range(2):
        info = export_checkpoint(base, full_checkpoint, out)
    assert info.linked_files == len(_unchanged(base)) - 2  # the base's README.md / export_info.json are not taken
    assert {k: p.read_bytes() for k, p in _files(base).items()} == before
    assert (out / "README.md").read_text().startswith("---\n") and (out / "README.md").stat().st_nlink == 1
    assert json.loads((out / "export_info.json").read_text())["checkpoint"] == str(full_checkpoint.resolve())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "export"]  # no staging folder left beside it


def test_across_file_systems_the_base_files_are_copied(full_checkpoint, tiny_sd3_dir, tmp_path):
    from diffusers import DiffusionPipeline

    shm = Path("/dev/shm")  # tmpfs on Linux (Docker gives every container one): another file system than /tmp's
    assert shm.is_dir() and shm.stat().st_dev != tmp_path.stat().st_dev, "the test needs /dev/shm on another file system"
    other = shm / f"omniflow-test-{uuid.uuid4().hex[:8]}"
    try:
        out = other / "export"
        info = export_checkpoint(tiny_sd3_dir, full_checkpoint, out)  # a link across file systems fails with EXDEV
        unchanged = _unchanged(Path(tiny_sd3_dir))
        assert (info.linked_files, info.copied_files) == (0, len(unchanged))
        for rel, src in unchanged.items():
            assert (out / rel).stat().st_ino != src.stat().st_ino and (out / rel).read_bytes() == src.read_bytes(), rel
        pipe = DiffusionPipeline.from_pretrained(out, local_files_only=True)
        trained = read_tensors(full_checkpoint / "actor", "model")
        assert all(torch.equal(pipe.transformer.state_dict()[k], v) for k, v in trained.items())
    finally:
        shutil.rmtree(other, ignore_errors=True)


def test_the_cli_export_card_names_format_and_weights(full_checkpoint, tmp_path, capsys):
    from omniflow.flows.cli import main as omniflow

    assert omniflow(["export", str(full_checkpoint), str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    info = json.loads((tmp_path / "out" / "export_info.json").read_text())
    assert f"{info['linked_files']} base-model file(s) hard-linked, 0 copied" in printed and info["linked_files"] > 10
    card = (tmp_path / "out" / "README.md").read_text()
    assert "| format | full |" in card and "| weights | the trained weights (no EMA) |" in card
    assert f"| steps trained | {STEP} |" in card and info["registered_model"] is None  # the run did not use mlflow


def test_a_run_that_tracked_with_mlflow_gets_its_export_registered(tiny_sd3_dir, tmp_path, one_torch_thread):
    """The registry of the run's own local mlflow store (`<checkpoint dir>/mlruns/mlflow.db`), the model version
    linked to the tracker run that logged the training."""
    from mlflow.tracking import MlflowClient

    from omni_core.trackers.mlflow_run import mlflow_tracking_uri
    from omni_core.tracking import TrackerRun, tracker_run_id

    root = tmp_path / "run"
    tracker = TrackerRun("omniflow", "handoff", tracker_run_id("omniflow", "handoff", root), {}, root)
    tracking = Tracking(["mlflow"], root / "logs", STEP, run=tracker)  # the run's tracker, as training makes it
    tracking.log({"critic/rewards/mean": -0.008}, step=STEP)
    tracking.close()
    ckpt = _write_run(root, Path(tiny_sd3_dir), ["console", "file", "mlflow"])

    infos = [export_checkpoint(tiny_sd3_dir, ckpt, tmp_path / name) for name in ("first", "second")]
    assert [i.registered_model for i in infos] == ["omniflow.handoff/1", "omniflow.handoff/2"]
    assert json.loads((tmp_path / "second" / "export_info.json").read_text())["registered_model"] == "omniflow.handoff/2"
    uri = mlflow_tracking_uri(root)
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    version = client.get_model_version("omniflow.handoff", "2")
    assert version.source == (tmp_path / "second").resolve().as_uri()
    assert version.run_id == tracking.mlflow_run_id
    assert (version.tags["omniflow.model_step"], version.tags["omniflow.export_kind"]) == (str(STEP), "full")


def test_the_export_task_materializes_the_export_folder_as_a_prefect_asset(prefect_api, full_checkpoint, tiny_sd3_dir, tmp_path):
    """The pipeline's `export_model` stage in a flow on the session's Prefect API; the asset read back from the API
    (its materialization event: the key is the folder, the metadata the export's record)."""
    import time
    from datetime import UTC, datetime

    from omniflow.tasks.export_model import export_asset, export_model
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter

    out = tmp_path / "export"

    @flow(name="export-handoff")
    def hand_off() -> dict:
        return vars(export_model(str(tiny_sd3_dir), str(full_checkpoint), str(out)))

    since = datetime.now(UTC)
    info = hand_off()
    key = f"file://{out.resolve()}"
    assert export_asset(out).key == key and info["out_dir"] == str(out.resolve())
    event_filter = EventFilter(
        event=EventNameFilter(name=["prefect.asset.materialization.succeeded"]),
        resource=EventResourceFilter(id=[key]),
        occurred=EventOccurredFilter(since=since),
    )
    deadline, events = time.monotonic() + 60, []
    while not events and time.monotonic() < deadline:  # the API persists events in batches
        with get_client(sync_client=True) as client:
            events = client.request("POST", "/events/filter", json={"filter": event_filter.model_dump(mode="json")}).json()[
                "events"
            ]
        time.sleep(0.5)
    assert len(events) == 1, events
    assert events[0]["resource"]["prefect.resource.name"] == "omniflow export export"
    payload = events[0]["payload"]
    assert (payload["kind"], payload["step"], payload["checkpoint"]) == ("full", STEP, str(full_checkpoint.resolve()))
    assert payload["linked_files"] == info["linked_files"] > 10


def test_the_card_names_a_hub_base_by_its_id_not_its_cache_folder(full_checkpoint, tiny_sd3_dir, tmp_path):
    """A base given as a Hub id is loaded from its snapshot folder in the HF cache; the card says the id."""
    export_checkpoint(
        tiny_sd3_dir, full_checkpoint, tmp_path / "export", base_model_name="stabilityai/stable-diffusion-3.5-medium"
    )
    card = (tmp_path / "export" / "README.md").read_text()
    assert "base_model: stabilityai/stable-diffusion-3.5-medium" in card and str(tiny_sd3_dir) not in card.split("---")[1]
