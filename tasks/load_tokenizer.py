"""Stage 4a — `load_tokenizer`: verl-omni's `_init_tokenizer()` (the model's first tokenizer, or
`model.tokenizer_path`), cached across runs.

The cached value is a `TokenizerInfo` (the folder the tokenizer loads from, and what it loaded as), stored as
JSON rather than a pickled tokenizer: a result file is data, never code that runs when a later run reads it.
`prepare_dataset` loads the tokenizer again from `TokenizerInfo.path` when it has prompts to check.

Cache key: the sha256 of the tokenizer folder's files plus `model.path` / `model.revision` / `model.tokenizer_path`,
the snapshot commit a Hub id resolves to (`hub.hub_snapshot`: a new revision of `main` is a new entry, never the
older one's) and the OmniFlow code version (`cache_keys.code_version`); a changed tokenizer file, another path or
revision or an upgrade makes it stale, nothing else does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefect import task

from omni_core.cache_keys import key_of
from omni_core.config.schema import ModelConfig
from omni_core.models.hub import TRANSFORMERS_SKIP, hub_snapshot
from omni_core.models.tokenizer import load_tokenizer as load_model_tokenizer
from omni_core.models.tokenizer import tokenizer_dir


@dataclass(frozen=True)
class TokenizerInfo:
    """Where the run's tokenizer lives and what it is (JSON-serialisable, so Prefect caches it without pickle)."""

    path: str  # the tokenizer folder (model.tokenizer_path, <model.path>/tokenizer, or model.path)
    name_or_path: str
    class_name: str
    vocab_size: int


def tokenizer_key(model: ModelConfig) -> str:
    """The cache key of `load_tokenizer(model)` (see the module docstring)."""
    fields = {
        "path": model.path,
        "revision": model.revision,
        "snapshot": hub_snapshot(model.path, model.revision),
        "tokenizer_path": model.tokenizer_path,
        "tokenizer_snapshot": hub_snapshot(model.tokenizer_path, skip=TRANSFORMERS_SKIP),
    }
    return key_of("tokenizer", [tokenizer_dir(model)], fields)


def _cache_key(context: Any, parameters: dict[str, Any]) -> str:
    return tokenizer_key(parameters["model"])


@task(name="load_tokenizer", cache_key_fn=_cache_key, persist_result=True, result_serializer="json", retries=1)
def load_tokenizer(model: ModelConfig) -> TokenizerInfo:
    tokenizer = load_model_tokenizer(model)  # loads it once, so a broken tokenizer folder fails here, named
    return TokenizerInfo(
        path=str(tokenizer_dir(model).resolve()),
        name_or_path=str(tokenizer.name_or_path),
        class_name=type(tokenizer).__name__,
        vocab_size=int(tokenizer.vocab_size),
    )
