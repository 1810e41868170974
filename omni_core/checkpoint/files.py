"""What goes inside a checkpoint, and reading it back: JSON state, safetensors, torch state dicts, config.

Formats are chosen so that loading never runs code from the file: JSON for controller state, safetensors
for tensors, and `torch.load(weights_only=True)` for optimizer / LR-scheduler state dicts (tensors,
numbers, strings and containers only). torch and safetensors are imported inside the functions so that
the flow process and lock holders that only need paths do not pay torch's import time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omni_core.checkpoint.layout import ACTOR_DIR, CONFIG_FILE, CheckpointError

if TYPE_CHECKING:
    import torch


def _file(base: str | Path, name: str, suffix: str) -> Path:
    """`<base>/<name><suffix>`; `name` may hold sub-folders but must stay inside `base`."""
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts or not name:
        raise ValueError(f"checkpoint file name {name!r} must be a relative path inside the checkpoint")
    path = Path(base) / f"{name}{suffix}"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def actor_dir(ckpt: str | Path) -> Path:
    """`<ckpt>/actor/`, where the training actor writes model and optimizer files itself."""
    path = Path(ckpt) / ACTOR_DIR
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_state(tmp: str | Path, name: str, obj: Any) -> Path:
    """`<tmp>/<name>.json` (dataloader, controller, RNG state); strict JSON, so NaN and objects are errors."""
    path = _file(tmp, name, ".json")
    try:
        text = json.dumps(obj, indent=1, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint state {name!r} is not JSON-serialisable: {exc}") from exc
    path.write_text(text + "\n")
    return path


def read_state(ckpt: str | Path, name: str) -> Any:
    path = Path(ckpt) / f"{name}.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing from checkpoint {ckpt}")
    return json.loads(path.read_text())


def write_tensors(tmp: str | Path, name: str, tensors: dict[str, torch.Tensor]) -> Path:
    """`<tmp>/<name>.safetensors`."""
    from safetensors.torch import save_file

    path = _file(tmp, name, ".safetensors")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path))
    return path


def read_tensors(ckpt: str | Path, name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = Path(ckpt) / f"{name}.safetensors"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing from checkpoint {ckpt}")
    return load_file(str(path))


def write_torch_state(tmp: str | Path, name: str, state: dict[str, Any]) -> Path:
    """`<tmp>/<name>.pt` for optimizer / LR-scheduler state dicts (read back with weights_only=True)."""
    import torch

    path = _file(tmp, name, ".pt")
    torch.save(state, path)
    return path


def read_torch_state(ckpt: str | Path, name: str, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a `.pt` state dict with `weights_only=True`: a file holding any other object is refused."""
    import pickle

    import torch

    path = Path(ckpt) / f"{name}.pt"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing from checkpoint {ckpt}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path}: holds objects other than tensors and plain containers; refusing to "
            f"unpickle it (only state dicts belong in a checkpoint)"
        ) from exc


def write_config(tmp: str | Path, yaml_text: str) -> Path:
    path = Path(tmp) / CONFIG_FILE
    path.write_text(yaml_text)
    return path


def read_config(ckpt: str | Path) -> str:
    path = Path(ckpt) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing from checkpoint {ckpt}")
    return path.read_text()
