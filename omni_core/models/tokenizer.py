"""The run's tokenizer (verl-omni's `_init_tokenizer()`): `model.tokenizer_path`, else the pipeline's
`tokenizer/` folder, else the model folder itself; loaded with `AutoTokenizer.from_pretrained`. Either path may be a
Hugging Face Hub id (`omni_core.models.hub`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omni_core.config.schema import ModelConfig
from omni_core.models.hub import TRANSFORMERS_SKIP, model_folder, resolve_model_path


def tokenizer_dir(model: ModelConfig) -> Path:
    """Where the tokenizer of `actor_rollout_ref.model` lives (what a cache key fingerprints)."""
    if model.tokenizer_path:
        return resolve_model_path(model.tokenizer_path, key="actor_rollout_ref.model.tokenizer_path", skip=TRANSFORMERS_SKIP)
    folder = model_folder(model)
    return folder / "tokenizer" if (folder / "tokenizer").is_dir() else folder


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
