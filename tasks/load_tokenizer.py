"""Stage 4a — `load_tokenizer`: verl-omni's `_init_tokenizer()` (the model's first tokenizer, or
`model.tokenizer_path`), cached across runs.

Cache key: the sha256 of the tokenizer folder's files plus `model.path` / `model.tokenizer_path`; a
changed tokenizer file or another path makes it stale, nothing else does.
"""

from __future__ import annotations

from typing import Any

from omniflow.tasks.cache_keys import key_of
from prefect import task

from omni_core.config.schema import ModelConfig
from omni_core.models.tokenizer import load_tokenizer as load_model_tokenizer
from omni_core.models.tokenizer import tokenizer_dir


def _cache_key(context: Any, parameters: dict[str, Any]) -> str:
    model: ModelConfig = parameters["model"]
    return key_of("tokenizer", [tokenizer_dir(model)], {"path": model.path, "tokenizer_path": model.tokenizer_path})


@task(name="load_tokenizer", cache_key_fn=_cache_key, persist_result=True, retries=1)
def load_tokenizer(model: ModelConfig) -> Any:
    return load_model_tokenizer(model)
