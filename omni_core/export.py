"""Export a trained checkpoint in diffusers format, for people who never run OmniFlow.

Full fine-tuning: the base pipeline folder with its ``transformer/`` replaced by the checkpoint's
``actor/hf`` (what ``TrainingActor.save`` writes with ``save_pretrained``), so
``DiffusionPipeline.from_pretrained(out_dir)`` loads the trained model. LoRA: only the adapter file
``pytorch_lora_weights.safetensors``, which ``pipe.load_lora_weights(out_dir)`` reads on top of the
base model. Either way ``export_info.json`` records where it came from and ``README.md`` is the model card
(``omni_core.model_card``); a run that tracked with mlflow gets the export registered as a new model version.
No Prefect here.

Training changes only the transformer, so the rest of a full export (VAE, text encoders, tokenizers, scheduler and
``model_index.json``) is hard links to the base model's files: no second copy on disk, written in no time. A file
is copied instead where a link cannot be made (another file system, or links not permitted there). The trained
transformer and the files the export writes (``README.md``, ``export_info.json``) are always new files, so editing
them never reaches the base. Linked files share their bytes with the base: replace them, never edit them in place.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from omni_core.checkpoint.layout import ACTOR_DIR, parse_step
from omni_core.model_card import CARD_FILE, config_value, model_card, read_run_config
from omni_core.models.loader import read_model_index
from omni_core.models.lora import LORA_WEIGHT_NAME

HF_DIR = "hf"
TRANSFORMER_DIR = "transformer"
INFO_FILE = "export_info.json"
# What the export writes itself at its top level: never linked from the base, even where the base has such a file.
WRITTEN = (TRANSFORMER_DIR, INFO_FILE, CARD_FILE)
# Where a hard link cannot be made and a copy is the answer: another file system (EXDEV); links not permitted
# (EPERM: a file system without them, or protected_hardlinks on a file of another user; EACCES); too many links
# to one file (EMLINK); links not supported (ENOTSUP / EOPNOTSUPP).
COPY_INSTEAD = {errno.EXDEV, errno.EPERM, errno.EACCES, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP}


@dataclass(frozen=True)
class ExportInfo:
    """What was exported: ``kind`` is ``"full"`` (a whole pipeline) or ``"lora"`` (an adapter file).

    ``linked_files`` / ``copied_files``: the base model's files in the export as hard links / as copies (0 and 0 for
    LoRA); ``registered_model``: ``"<name>/<version>"`` in mlflow's model registry, or None (the run did not track
    with mlflow).
    """

    base_model: str
    checkpoint: str
    step: int | None
    kind: str
    out_dir: str
    linked_files: int = 0
    copied_files: int = 0
    registered_model: str | None = None


class _LinkOrCopy:
    """`shutil.copytree`'s copy function: a hard link to the base's file, a copy where the link cannot be made."""

    def __init__(self) -> None:
        self.linked = self.copied = 0

    def __call__(self, src: str, dst: str) -> str:
        try:
            os.link(src, dst)  # follows a symlinked source (a Hugging Face cache snapshot): links the file itself
            self.linked += 1
        except OSError as exc:
            if exc.errno not in COPY_INSTEAD:
                raise
            shutil.copy2(src, dst)
            self.copied += 1
        return dst


def export_checkpoint(
    base_model_dir: str | Path,
    checkpoint: str | Path,
    out_dir: str | Path,
    trained_checkpoint: str | Path | None = None,
    details: Mapping[str, str] | None = None,
    base_model_name: str | None = None,
) -> ExportInfo:
    """Write the checkpoint's transformer (full) or adapter (LoRA) to ``out_dir``; returns what was written.

    An earlier export in ``out_dir`` (it has ``export_info.json``) is replaced, so a re-export never mixes
    files of two checkpoints; any other non-empty folder is refused rather than deleted, and so is a folder
    that is, contains or sits inside the base model or the checkpoint (even one holding ``export_info.json``).
    ``trained_checkpoint``: the training checkpoint the card and the registry describe when ``checkpoint`` is a
    staging folder that holds only ``actor/hf`` (default ``checkpoint``); ``details``: more rows for the card;
    ``base_model_name``: the base as the card names it (a Hub id rather than its snapshot folder; default the folder).
    """
    base, ckpt, out = Path(base_model_dir).resolve(), Path(checkpoint).resolve(), Path(out_dir).resolve()
    trained = Path(trained_checkpoint).resolve() if trained_checkpoint is not None else ckpt
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
    link = _LinkOrCopy()
    if (hf / LORA_WEIGHT_NAME).is_file():
        kind = "lora"
        tmp.mkdir(parents=True)
        shutil.copy2(hf / LORA_WEIGHT_NAME, tmp / LORA_WEIGHT_NAME)
    else:
        kind = "full"
        shutil.copytree(
            base, tmp, ignore=lambda d, names: [n for n in WRITTEN if n in names] if Path(d) == base else [], copy_function=link
        )
        shutil.copytree(hf, tmp / TRANSFORMER_DIR)  # the trained weights: new files, never links
    step = parse_step(trained)
    info = ExportInfo(
        base_model=str(base),
        checkpoint=str(trained),
        step=step,
        kind=kind,
        out_dir=str(out),
        linked_files=link.linked,
        copied_files=link.copied,
    )
    (tmp / CARD_FILE).write_text(model_card(base_model_name or str(base), trained, step, kind, out, details))
    (tmp / INFO_FILE).write_text(json.dumps(asdict(info), indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)  # unlinks an earlier export's links: the base's files stay
    tmp.rename(out)

    config = read_run_config(trained)
    if "mlflow" in (config_value(config, "trainer.logger") or []):
        from omni_core.trackers.mlflow_run import register_export

        project = config_value(config, "trainer.project_name")
        experiment = config_value(config, "trainer.experiment_name")
        run_dir = Path(config_value(config, "trainer.default_local_dir") or trained.parent).expanduser()
        info = replace(info, registered_model=register_export(trained.parent, project, experiment, run_dir, out, step, kind))
        write_file(out / INFO_FILE, json.dumps(asdict(info), indent=1) + "\n")
    return info


def write_file(path: Path, text: str) -> None:
    """`text` as a new file at `path`, renamed over what was there: a file the export holds is never edited in
    place (were it a link, the edit would reach the base model)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
