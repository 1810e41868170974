"""Whether a checkpoint can be resumed under the current config: the keys its state depends on must match.

Each checkpoint holds the resolved config of the run that wrote it (`config.yaml`). On resume:
- keys that shape the saved tensors or their meaning (the model, LoRA on/off and its rank and target
  modules, the weights' dtype, a sharded vs a whole-state strategy) must equal the checkpoint's: loading a LoRA adapter of rank 8
  into rank 16, or fp32 Adam state into a bf16 model, is an error (or worse, a silent mix-up), so resume is
  refused with each differing key, its old and new value, and the fix;
- optimizer hyperparameters (`lr`, `betas`, `weight_decay`) may change: the new values are applied over the
  loaded optimizer state (the training actor does that) and the change is logged;
- the world size (`trainer.n_gpus_per_node x trainer.nnodes`) may change: torch / ddp checkpoints hold the whole
  state, fsdp2 ones are resharded on load; it is logged, since a resume is bit-identical only on as many ranks;
- a checkpoint saved without the optimizer (`actor.checkpoint.save_contents` lacking `optimizer`) is
  export-only: resuming from it would restart Adam from zero state mid-run, so it is refused.

Plain dicts in, messages out: no torch, no pydantic objects (the validation package calls it too).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from omni_core.checkpoint.files import read_config
from omni_core.checkpoint.layout import ACTOR_DIR, CheckpointError
from omni_core.checkpoint.writer import read_manifest

# Keys a resumed run must share with its checkpoint.
LOCKED_KEYS = (
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.revision",
    "actor_rollout_ref.model.architecture",
    "actor_rollout_ref.model.lora_rank",
    "actor_rollout_ref.actor.fsdp_config.model_dtype",
)
LORA_KEYS = ("actor_rollout_ref.model.target_modules",)  # locked too, when LoRA is on
WORLD_SIZE_KEY = "trainer.n_gpus_per_node x trainer.nnodes"
# Keys whose new value is applied over the loaded optimizer state.
OPTIMIZER_KEYS = (
    "actor_rollout_ref.actor.optim.lr",
    "actor_rollout_ref.actor.optim.betas",
    "actor_rollout_ref.actor.optim.weight_decay",
)
OPTIMIZER_FILE = f"{ACTOR_DIR}/optimizer.pt"
SHARDED_DIR = f"{ACTOR_DIR}/dcp/"  # actor.strategy=fsdp2: model and optimizer shards (torch.distributed.checkpoint)


def _get(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return list(node) if isinstance(node, tuple) else node


def _same(key: str, old: Any, new: Any) -> bool:
    if key.endswith("model.path") and old is not None and new is not None:
        return Path(str(old)).expanduser().resolve() == Path(str(new)).expanduser().resolve()
    return old == new


def saved_config(ckpt: str | Path) -> dict[str, Any] | None:
    """The config a checkpoint was written with, or None when it has none (written by hand or by a test)."""
    try:
        tree = yaml.safe_load(read_config(ckpt))
    except CheckpointError:
        return None
    except yaml.YAMLError as exc:
        raise CheckpointError(f"{Path(ckpt) / 'config.yaml'}: unreadable ({exc})") from exc
    return tree if isinstance(tree, dict) else None


def config_changes(
    saved: dict[str, Any], current: dict[str, Any]
) -> tuple[list[tuple[str, Any, Any]], list[tuple[str, Any, Any]]]:
    """(refused, applied): `(key, checkpoint value, current value)` for locked keys that differ, and for optimizer
    keys that differ. A key missing from the saved config (an older OmniFlow) is not compared."""
    keys = list(LOCKED_KEYS)
    if _get(current, "actor_rollout_ref.model.lora_rank"):
        keys += LORA_KEYS
    refused = []
    for key in keys:
        old, new = _get(saved, key), _get(current, key)
        if old is not None and not _same(key, old, new):
            refused.append((key, old, new))
    world = (
        [_get(tree, "trainer.n_gpus_per_node") for tree in (saved, current)],
        [_get(tree, "trainer.nnodes") for tree in (saved, current)],
    )
    changed_world = None
    if None not in world[0] + world[1]:
        old_ws, new_ws = world[0][0] * world[1][0], world[0][1] * world[1][1]
        if old_ws != new_ws:
            changed_world = (WORLD_SIZE_KEY, f"{world[0][0]} x {world[1][0]}", f"{world[0][1]} x {world[1][1]}")
    strategies = [_get(tree, "actor_rollout_ref.actor.strategy") for tree in (saved, current)]
    if None not in strategies and (strategies[0] == "fsdp2") != (strategies[1] == "fsdp2"):
        # torch / ddp checkpoints hold the whole state; fsdp2 ones hold shards: neither loads into the other.
        refused.append(("actor_rollout_ref.actor.strategy", strategies[0], strategies[1]))
    applied = []
    for key in OPTIMIZER_KEYS:
        old, new = _get(saved, key), _get(current, key)
        if old is not None and old != new:
            applied.append((key, old, new))
    if changed_world is not None:
        applied.append(changed_world)
    return refused, applied


def refusal_fix(key: str, old: Any) -> str:
    return f"set {key}={old} to resume it, or start a new experiment (trainer.experiment_name=<new name>)"


def has_optimizer(ckpt: str | Path) -> bool:
    """Saved with the optimizer: `actor/optimizer.pt`, or an FSDP2 checkpoint's sharded state (`actor/dcp/`)."""
    return any(entry["path"] == OPTIMIZER_FILE or entry["path"].startswith(SHARDED_DIR) for entry in read_manifest(ckpt)["files"])


def export_only_message(ckpt: str | Path) -> str:
    return (
        f"checkpoint {ckpt} was saved without the optimizer (actor_rollout_ref.actor.checkpoint.save_contents "
        f"lacked 'optimizer'): such checkpoints are export-only and cannot be resumed. Resume from a checkpoint "
        f"saved with the optimizer, export this one (omniflow export), or start a new experiment "
        f"(trainer.experiment_name=<new name>)"
    )


def check_resume_config(ckpt: str | Path, current: dict[str, Any]) -> list[str]:
    """Raise `CheckpointError` when `ckpt` cannot be resumed under `current` (the config as a JSON dict);
    returns one line per optimizer hyperparameter whose new value replaces the checkpoint's, and one for a new
    world size."""
    if not has_optimizer(ckpt):
        raise CheckpointError(export_only_message(ckpt))
    saved = saved_config(ckpt)
    if saved is None:
        return []
    refused, applied = config_changes(saved, current)
    if refused:
        lines = [f"{key}: checkpoint {old!r}, now {new!r} ({refusal_fix(key, old)})" for key, old, new in refused]
        raise CheckpointError(f"cannot resume {ckpt} under a changed config:\n  " + "\n  ".join(lines))
    return [
        f"{key} changed since {ckpt}: {old!r} -> {new!r}; "
        + (
            "the ranks take new slices of each mini-batch (the run goes on, but not bit for bit as on the old ranks)"
            if key == WORLD_SIZE_KEY
            else "applying the new value over the loaded optimizer state"
        )
        for key, old, new in applied
    ]
