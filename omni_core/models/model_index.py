"""A saved diffusers pipeline's `model_index.json`, read without importing diffusers (~3 s on 2 cores): what
cache keys and checks that only list a folder's components need (`prompt_embeddings.text_encoder_fingerprint`)."""

from __future__ import annotations

import json
from pathlib import Path


class ModelLoadError(ValueError):
    """A model directory could not be loaded; the message names the path and the problem."""


def read_model_index(path: Path) -> dict:
    index_file = path / "model_index.json"
    if not index_file.is_file():
        raise ModelLoadError(f"{path}: no model_index.json; expected a diffusers pipeline directory written by save_pretrained")
    try:
        return json.loads(index_file.read_text())
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{index_file}: not valid JSON ({err})") from err
