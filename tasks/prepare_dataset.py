"""Stage 4b — `prepare_dataset`: verl-omni's `_init_dataloader()` datasets (`create_rl_dataset` for train and val,
`truncation: error` against the tokenizer), cached across runs.

The records are stored as JSON (`result_serializer="json"`), not pickled: reading a cached result never runs
code. `PromptRecord` (and `PreferencePair`) is a plain dataclass of JSON values, so the records come back equal.

Cache key: the sha256 of every prompt file plus the `data.*` fields that shape the records
(`train_files`, `val_files`, `prompt_key`, `negative_prompt_key`, `train/val_max_samples`, `max_prompt_length`, the
pair columns `img_win_key` ...) and whether they hold preference pairs (offline samples), the tokenizer they were checked with and the OmniFlow code version (`cache_keys.code_version`); any other
change leaves it valid.
"""

from __future__ import annotations

from typing import Any

from omniflow.tasks.load_tokenizer import TokenizerInfo
from prefect import task

from omni_core.cache_keys import key_of
from omni_core.config.schema import DataConfig, ModelConfig
from omni_core.data.datasets import dataset_files, load_datasets
from omni_core.data.prompts import PromptRecord
from omni_core.models.tokenizer import load_tokenizer

KEY_FIELDS = (
    "train_files",
    "val_files",
    "prompt_key",
    "negative_prompt_key",
    "train_max_samples",
    "val_max_samples",
    "max_prompt_length",
    "img_win_key",
    "img_lose_key",
    "win_score_key",
    "lose_score_key",
)


def _cache_key(context: Any, parameters: dict[str, Any]) -> str:
    data: DataConfig = parameters["data"]
    tokenizer: TokenizerInfo = parameters["tokenizer"]
    fields = {k: getattr(data, k) for k in KEY_FIELDS}
    fields["tokenizer"] = tokenizer.path
    fields["pairs"] = parameters.get("pairs", False)  # the image files are keyed by prepare_pair_latents, which reads them
    return key_of("dataset", dataset_files(data), fields)


@task(name="prepare_dataset", cache_key_fn=_cache_key, persist_result=True, result_serializer="json")
def prepare_dataset(
    data: DataConfig, tokenizer: TokenizerInfo, pairs: bool = False
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """(train prompts, validation prompts), each checked against `data.max_prompt_length`; `pairs` (offline
    samples): the files hold preference pairs and the records are `PreferencePair`s."""
    return load_datasets(data, load_tokenizer(ModelConfig(path=tokenizer.path, tokenizer_path=tokenizer.path)), pairs)
