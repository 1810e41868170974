"""A finished checkpoint as `omniflow export` and `omniflow evaluate` open it, and the refusals they share.

`open_trained_checkpoint` takes what a user points at: a `global_step_N` folder, or an experiment folder
(`trainer.default_local_dir`, meaning its newest complete checkpoint), verifies every file against the
manifest (sha256), and says what it holds: the saved config (`config.yaml`), whether the weights are a LoRA
adapter or the whole transformer (the diffusers copy in `actor/hf`), and whether the run kept an EMA
(`actor/ema.safetensors`, which `actor/hf` then holds instead of the trained weights).

A command that cannot use its arguments raises `RefusedError` before writing anything; the message names the
argument and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omni_core.checkpoint.files import read_tensors
from omni_core.checkpoint.layout import ACTOR_DIR, CONFIG_FILE, EMA_NAME, CheckpointError, complete_steps, is_complete, parse_step
from omni_core.checkpoint.resume import find_latest
from omni_core.checkpoint.writer import verify_checkpoint
from omni_core.export import HF_DIR
from omni_core.models.lora import LORA_WEIGHT_NAME
from omni_core.models.policy import FlowPolicy

MODEL_NAME = "model"  # <checkpoint>/actor/model.safetensors: the trained weights (TrainingActor.save)


class RefusedError(ValueError):
    """A command refused its arguments; nothing was written. The message names the argument and the fix."""


@dataclass(frozen=True)
class TrainedCheckpoint:
    """A verified checkpoint folder and what it holds.

    Attributes:
        path: the `global_step_N` folder.
        step: N.
        is_lora: the weights are a LoRA adapter (`actor/hf/pytorch_lora_weights.safetensors`), not a transformer.
        has_ema: the run kept an EMA (`actor/ema.safetensors`); `actor/hf` then holds the average.
    """

    path: Path
    step: int
    is_lora: bool
    has_ema: bool

    @property
    def config_file(self) -> Path:
        """The resolved config the run saved with this checkpoint."""
        return self.path / CONFIG_FILE

    @property
    def hf_dir(self) -> Path:
        return self.path / ACTOR_DIR / HF_DIR

    @property
    def hf_weights(self) -> str:
        """Which weights `actor/hf` holds: `"ema"` when the run kept an EMA, else `"model"`."""
        return EMA_NAME if self.has_ema else MODEL_NAME

    def weights(self, ema: bool | None, argument: str = "--ema") -> str:
        """`"ema"` or `"model"`: the EMA when kept unless `ema` is False; `ema=True` without one is refused."""
        if ema and not self.has_ema:
            raise RefusedError(
                f"{argument}: {self.path} kept no EMA (actor_rollout_ref.actor.ema.enable was false in its run); "
                f"drop {argument} to use the trained weights"
            )
        return EMA_NAME if self.has_ema and ema is not False else MODEL_NAME


def open_trained_checkpoint(checkpoint: str | Path, argument: str = "CHECKPOINT") -> TrainedCheckpoint:
    """The checkpoint `checkpoint` names (a `global_step_N` folder, or an experiment folder: its newest complete
    one), checked against its manifest; `RefusedError` naming `argument` when it is missing, incomplete, damaged,
    or lacks the files the commands read (`config.yaml`, `actor/hf`)."""
    given = Path(checkpoint).expanduser()
    if not given.exists():
        raise RefusedError(
            f"{argument}={checkpoint} does not exist; pass a global_step_N checkpoint folder or an experiment folder"
        )
    if parse_step(given) is not None:
        if not is_complete(given):
            raise RefusedError(
                f"{argument}={checkpoint} is incomplete (no manifest.json: its save never finished); pass a complete "
                f"checkpoint, e.g. the experiment folder {given.parent} for its newest one"
            )
        path = given
    else:
        path = find_latest(given)
        if path is None:
            raise RefusedError(
                f"{argument}={checkpoint} holds no complete checkpoint (global_step_N folder with a manifest.json); "
                f"pass a global_step_N folder or the experiment folder of a run that saved one"
            )
    try:
        verify_checkpoint(path, hashes=True)
    except CheckpointError as exc:
        older = sorted(s for s in complete_steps(path.parent) if s != parse_step(path))
        hint = f"; other checkpoints there: steps {older}" if older else ""
        raise RefusedError(f"{argument}={checkpoint}: {exc}. Restore the files or pass another checkpoint{hint}") from exc
    path = path.resolve()
    ckpt = TrainedCheckpoint(
        path=path,
        step=parse_step(path),  # type: ignore[arg-type]
        is_lora=(path / ACTOR_DIR / HF_DIR / LORA_WEIGHT_NAME).is_file(),
        has_ema=(path / ACTOR_DIR / f"{EMA_NAME}.safetensors").is_file(),
    )
    for needed, what in ((ckpt.config_file, "the run's config"), (ckpt.hf_dir, "the diffusers copy of the weights")):
        if not needed.exists():
            raise RefusedError(
                f"{argument}={checkpoint}: {path} has no {needed.relative_to(path)} ({what}); it was not written by an "
                f"OmniFlow training run. Pass a checkpoint of one"
            )
    return ckpt


def require_new_folder(out: str | Path, argument: str = "OUT") -> Path:
    """`out` as a path, refused when it exists and is not an empty folder (a command never overwrites anything)."""
    path = Path(out).expanduser()
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        kind = "a folder that is not empty" if path.is_dir() else "a file"
        raise RefusedError(f"{argument}={out} is {kind}; nothing is ever overwritten: pass a new (or empty) folder")
    return path


def new_folder_next_to(path: Path, name: str) -> Path:
    """`<path's folder>/<name>`, or `<name>-2`, `-3`, ... : the first that does not exist yet."""
    candidate, n = path.parent / name, 1
    while candidate.exists():
        n += 1
        candidate = path.parent / f"{name}-{n}"
    return candidate


def load_checkpoint_weights(policy: FlowPolicy, checkpoint: str | Path, ema: bool = True) -> str:
    """Load a training checkpoint's weights into `policy`: `actor/ema.safetensors` when the run kept an EMA, else
    `actor/model.safetensors` (the files TrainingActor.save writes: full state, or the LoRA adapter). `ema=False`
    loads the trained weights even where an EMA was kept. Returns the name loaded (`"ema"` or `"model"`)."""
    actor = Path(checkpoint) / ACTOR_DIR
    name = EMA_NAME if ema and (actor / f"{EMA_NAME}.safetensors").is_file() else MODEL_NAME
    policy.load_trainable_state(read_tensors(actor, name))
    return name
