"""Stage 4a — `load_tokenizer`: verl-omni's `_init_tokenizer()` (the model's first tokenizer, or
`model.tokenizer_path`), cached across runs.

Cache key: the sha256 of the tokenizer folder's files plus `model.path` / `model.tokenizer_path`; a
changed tokenizer file or another path makes it stale, nothing else does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omniflow.tasks.cache_keys import key_of
from prefect import task

from omni_core.config.schema import ModelConfig


def tokenizer_dir(model: ModelConfig) -> Path:
    if model.tokenizer_path:
        return Path(model.tokenizer_path).expanduser()
    sub = Path(model.path).expanduser() / "tokenizer"
    return sub if sub.is_dir() else Path(model.path).expanduser()


def _cache_key(context: Any, parameters: dict[str, Any]) -> str:
    model: ModelConfig = parameters["model"]
    return key_of("tokenizer", [tokenizer_dir(model)], {"path": model.path, "tokenizer_path": model.tokenizer_path})


@task(name="load_tokenizer", cache_key_fn=_cache_key, persist_result=True, retries=1)
def load_tokenizer(model: ModelConfig) -> Any:
    from transformers import AutoTokenizer

    path = tokenizer_dir(model)
    if not path.is_dir():
        raise FileNotFoundError(
            f"actor_rollout_ref.model.path={model.path}: no tokenizer at {path}; build the tiny model with "
            f"`omniflow make-tiny-model {model.path}` or point model.path at a diffusers pipeline folder"
        )
    return AutoTokenizer.from_pretrained(str(path))
