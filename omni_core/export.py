"""Export a trained checkpoint in diffusers format, for people who never run OmniFlow.

Full fine-tuning: the base pipeline folder with its ``transformer/`` replaced by the checkpoint's
``actor/hf`` (what ``TrainingActor.save`` writes with ``save_pretrained``), so
``DiffusionPipeline.from_pretrained(out_dir)`` loads the trained model. LoRA: only the adapter file
``pytorch_lora_weights.safetensors``, which ``pipe.load_lora_weights(out_dir)`` reads on top of the
base model. Either way ``export_info.json`` records where it came from. No Prefect here.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from omni_core.checkpoint.layout import ACTOR_DIR, parse_step
from omni_core.models.loader import read_model_index
from omni_core.models.lora import LORA_WEIGHT_NAME

HF_DIR = "hf"
TRANSFORMER_DIR = "transformer"
INFO_FILE = "export_info.json"


@dataclass(frozen=True)
class ExportInfo:
    """What was exported: ``kind`` is ``"full"`` (a whole pipeline) or ``"lora"`` (an adapter file)."""

    base_model: str
    checkpoint: str
    step: int | None
    kind: str
    out_dir: str


def export_checkpoint(base_model_dir: str | Path, checkpoint: str | Path, out_dir: str | Path) -> ExportInfo:
    """Write the checkpoint's transformer (full) or adapter (LoRA) to ``out_dir``; returns what was written.

    An earlier export in ``out_dir`` (it has ``export_info.json``) is replaced, so a re-export never mixes
    files of two checkpoints; any other non-empty folder is refused rather than deleted, and so is a folder
    that is, contains or sits inside the base model or the checkpoint (even one holding ``export_info.json``).
    """
    base, ckpt, out = Path(base_model_dir).resolve(), Path(checkpoint).resolve(), Path(out_dir).resolve()
    hf = ckpt / ACTOR_DIR / HF_DIR
    if not hf.is_dir():
        raise FileNotFoundError(f"checkpoint={ckpt}: no {ACTOR_DIR}/{HF_DIR} folder; pass a global_step_N checkpoint folder")
    read_model_index(base)  # a clear error if the base is not a diffusers pipeline folder
    # An export replaces its target folder: it must neither be, hold, nor sit inside the base model or the
    # checkpoint (paths resolved, so a symlink cannot hide either).
    for name, folder in (("base model", base), ("checkpoint", ckpt)):
        if out == folder or out in folder.parents or folder in out.parents:
            raise ValueError(
                f"export_dir={out} {'is' if out == folder else 'contains' if out in folder.parents else 'is inside'} "
                f"the {name} folder {folder}; replacing it would delete or mix with it. Choose an export folder "
                f"outside both the base model ({base}) and the checkpoint ({ckpt})"
            )
    if out.exists() and any(out.iterdir()) and not (out / INFO_FILE).is_file():
        raise FileExistsError(f"export_dir={out} is not empty and holds no earlier export ({INFO_FILE}); choose an empty folder")

    # Written next to `out` and renamed into place: an interrupted export never looks like a finished one
    # (and never blocks the next), and an earlier export is replaced only once the new one is complete.
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if (hf / LORA_WEIGHT_NAME).is_file():
        kind = "lora"
        tmp.mkdir(parents=True)
        shutil.copy2(hf / LORA_WEIGHT_NAME, tmp / LORA_WEIGHT_NAME)
    else:
        kind = "full"
        shutil.copytree(base, tmp, ignore=lambda d, names: [TRANSFORMER_DIR] if Path(d) == base else [])
        shutil.copytree(hf, tmp / TRANSFORMER_DIR)
    info = ExportInfo(base_model=str(base), checkpoint=str(ckpt), step=parse_step(ckpt), kind=kind, out_dir=str(out))
    (tmp / INFO_FILE).write_text(json.dumps(asdict(info), indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return info
