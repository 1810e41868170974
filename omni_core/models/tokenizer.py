"""The run's tokenizer (verl-omni's `_init_tokenizer()`): `model.tokenizer_path`, else the pipeline's
`tokenizer/` folder, else the model folder itself; loaded with `AutoTokenizer.from_pretrained`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omni_core.config.schema import ModelConfig


def tokenizer_dir(model: ModelConfig) -> Path:
    """Where the tokenizer of `actor_rollout_ref.model` lives (what a cache key fingerprints)."""
    if model.tokenizer_path:
        return Path(model.tokenizer_path).expanduser()
    sub = Path(model.path).expanduser() / "tokenizer"
    return sub if sub.is_dir() else Path(model.path).expanduser()


def load_tokenizer(model: ModelConfig) -> Any:
    """The tokenizer; a missing folder is an error that names the key and the fix."""
    from transformers import AutoTokenizer

    path = tokenizer_dir(model)
    if not path.is_dir():
        raise FileNotFoundError(
            f"actor_rollout_ref.model.path={model.path}: no tokenizer at {path}; build the tiny model with "
            f"`omniflow make-tiny-model {model.path}` or point model.path at a diffusers pipeline folder"
        )
    return AutoTokenizer.from_pretrained(str(path))
