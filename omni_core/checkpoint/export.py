"""`omniflow export`: a finished training checkpoint as a diffusers folder, in the format asked for.

Formats (`FORMATS`):
- `full`: the whole pipeline with the trained transformer (`DiffusionPipeline.from_pretrained(out)` loads it);
  the default for a full fine-tuning checkpoint.
- `lora`: the adapter file `pytorch_lora_weights.safetensors`, which `pipe.load_lora_weights(out)` reads on top of
  the base model; the default for a LoRA checkpoint, refused for a full fine-tuning one (it has no adapter).
- `merged`: a LoRA checkpoint's adapter merged into the base transformer (peft's `merge_and_unload`), written as a
  whole pipeline like `full`; for a full fine-tuning checkpoint it is `full` (nothing to merge).

Weights: the EMA when the run kept one (what its validation sampled with), unless `ema=False`; `ema=True` on a
checkpoint without one is refused. The checkpoint's `actor/hf` already holds those weights in diffusers format
(`TrainingActor.save`), so the usual export is a verified copy through `omni_core.export.export_checkpoint`.
Otherwise (the trained weights of an EMA run, or `merged`) the weights are loaded into a `FlowPolicy` of the saved
config (`omni_core.checkpoint.trained.load_checkpoint_weights`), written with `FlowPolicy.save_pretrained` (or the merged
transformer's `save_pretrained`) as a staged `actor/hf`, and copied the same way. `export_info.json` in the output
says what was written and `README.md` is the model card; the base model's unchanged files are hard links (a copy
across file systems), and a run that tracked with mlflow gets the export registered (see `omni_core.export`).
Nothing existing is ever overwritten: the output folder must be new or empty.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from omni_core.checkpoint.layout import ACTOR_DIR
from omni_core.checkpoint.trained import (
    RefusedError,
    TrainedCheckpoint,
    load_checkpoint_weights,
    open_trained_checkpoint,
    require_new_folder,
)
from omni_core.config import ConfigError, OmniFlowConfig, load_config, with_updates
from omni_core.export import HF_DIR, INFO_FILE, ExportInfo, export_checkpoint, write_file
from omni_core.models.hub import is_hub_id, model_folder
from omni_core.models.loader import check_pipeline_folder
from omni_core.models.model_index import ModelLoadError

FORMATS = ("full", "lora", "merged")
MODEL_PATH_KEY = "actor_rollout_ref.model.path"


@dataclass(frozen=True)
class CheckpointExport:
    """What `export_trained_checkpoint` wrote (also `export_info.json` in `out_dir`).

    `kind` is `"full"` (a whole pipeline) or `"lora"` (an adapter file), as in `omni_core.export.ExportInfo`;
    `format` the format written (`merged` is a full pipeline); `weights` `"ema"` or `"model"` (the trained weights);
    `linked_files`, `copied_files` and `registered_model` as in `ExportInfo`.
    """

    base_model: str
    checkpoint: str
    step: int
    kind: str
    format: str
    weights: str
    out_dir: str
    linked_files: int = 0
    copied_files: int = 0
    registered_model: str | None = None


def export_trained_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    format: str | None = None,  # noqa: A002  (the command's --format)
    ema: bool | None = None,
    base_model: str | Path | None = None,
) -> CheckpointExport:
    """Export `checkpoint` (a `global_step_N` folder, or an experiment folder: its newest) to the new folder `out_dir`.

    `format`: one of `FORMATS`, default `lora` for a LoRA checkpoint and `full` otherwise. `ema`: None uses the EMA
    when kept, False the trained weights, True requires the EMA. `base_model`: the base pipeline folder, default the
    checkpoint config's `actor_rollout_ref.model.path`. Raises `RefusedError` (nothing written) for a missing or
    damaged checkpoint, a non-empty `out_dir`, or a format the checkpoint cannot give.
    """
    out = require_new_folder(out_dir)  # first: it costs nothing, the manifest check reads every byte
    ckpt = open_trained_checkpoint(checkpoint)
    fmt = format or ("lora" if ckpt.is_lora else "full")
    if fmt not in FORMATS:
        raise RefusedError(f"--format {fmt}: not one of {', '.join(FORMATS)}")
    if fmt == "lora" and not ckpt.is_lora:
        raise RefusedError(
            f"--format lora: {ckpt.path} is a full fine-tuning checkpoint (actor_rollout_ref.model.lora_rank=0): it holds "
            f"the whole transformer, no adapter. Use --format full"
        )
    if fmt == "merged" and not ckpt.is_lora:
        fmt = "full"  # nothing to merge: the transformer is the trained one already
    weights = ckpt.weights(ema)
    config = _saved_config(ckpt, base_model)
    base = model_folder(config.actor_rollout_ref.model)  # a Hub id: its snapshot in the Hugging Face cache

    details = {"format": fmt, "weights": "the EMA" if weights == "ema" else "the trained weights (no EMA)"}
    # A Hub id: the card names it, not its snapshot folder in the cache.
    base_name = config.actor_rollout_ref.model.path if is_hub_id(config.actor_rollout_ref.model.path) else None
    if fmt != "merged" and weights == ckpt.hf_weights:
        written = _copy(base, ckpt.path, out, out_dir, ckpt, details, base_name)  # actor/hf holds exactly these weights
    else:
        stage = out.with_name(f".{out.name}.stage-{os.getpid()}")  # a checkpoint-like folder holding only actor/hf
        shutil.rmtree(stage, ignore_errors=True)
        try:
            _write_hf(config, ckpt, weights, merge=fmt == "merged", hf_dir=stage / ACTOR_DIR / HF_DIR)
            written = _copy(base, stage, out, out_dir, ckpt, details, base_name)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    info = CheckpointExport(
        base_model=str(base.resolve()),
        checkpoint=str(ckpt.path),
        step=ckpt.step,
        kind=written.kind,
        format=fmt,
        weights=weights,
        out_dir=written.out_dir,
        linked_files=written.linked_files,
        copied_files=written.copied_files,
        registered_model=written.registered_model,
    )
    write_file(out / INFO_FILE, json.dumps(asdict(info), indent=1) + "\n")
    return info


def _saved_config(ckpt: TrainedCheckpoint, base_model: str | Path | None) -> OmniFlowConfig:
    """The run's config (its `config.yaml`), with `base_model` as the model path when given; the base folder checked."""
    try:
        config = load_config([ckpt.config_file])
        if base_model is not None:
            config = with_updates(config, {MODEL_PATH_KEY: str(base_model)})
    except ConfigError as exc:
        raise RefusedError(f"CHECKPOINT={ckpt.path}: its {ckpt.config_file.name} does not load: {exc}") from exc
    model = config.actor_rollout_ref.model
    try:
        check_pipeline_folder(model_folder(model), model.architecture)
    except ModelLoadError as exc:
        where = "--base-model" if base_model is not None else f"{MODEL_PATH_KEY} in {ckpt.config_file}"
        raise RefusedError(f"{where}: {exc}; pass --base-model DIR, the base pipeline folder the run trained") from exc
    return config


def _copy(
    base: Path,
    source: Path,
    out: Path,
    out_dir: str | Path,
    ckpt: TrainedCheckpoint,
    details: dict[str, str],
    base_name: str | None,
) -> ExportInfo:
    """`export_checkpoint` (base pipeline + `source/actor/hf`, written aside and renamed into `out`; card and registry
    from `ckpt`, the card naming the base `base_name` when given); an `out` that is, holds or sits inside the base
    model or the checkpoint is refused there."""
    try:
        return export_checkpoint(base, source, out, trained_checkpoint=ckpt.path, details=details, base_model_name=base_name)
    except (ValueError, FileExistsError) as exc:
        raise RefusedError(f"OUT={out_dir}: {exc}") from exc


def _write_hf(config: OmniFlowConfig, ckpt: TrainedCheckpoint, weights: str, merge: bool, hf_dir: Path) -> None:
    """The chosen weights in diffusers format in `hf_dir`: the transformer (full, or LoRA merged into it) or the
    adapter file, as `TrainingActor.save` writes `actor/hf`."""
    from omni_core.models.placement import torch_dtype
    from omni_core.models.policy import FlowPolicy

    # The trained copy's dtype (what model.safetensors holds), on the CPU, no text encoders: nothing runs forward.
    policy = FlowPolicy.from_model_config(
        config.actor_rollout_ref.model,
        dtype=torch_dtype(config.actor_rollout_ref.actor.fsdp_config.model_dtype),
        device="cpu",
        attn_backend="native",
        text_encoders=False,
        trainable=False,
    )
    loaded = load_checkpoint_weights(policy, ckpt.path, ema=weights != "model")
    assert loaded == weights, (loaded, weights)
    if merge:
        policy.transformer.merge_and_unload().save_pretrained(hf_dir, safe_serialization=True)
    else:
        policy.save_pretrained(hf_dir)
