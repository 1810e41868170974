"""Stage 4b — `prepare_dataset`: verl-omni's `_init_dataloader()` datasets (`create_rl_dataset` for train and val,
`truncation: error` against the tokenizer), cached across runs.

Cache key: the sha256 of every prompt file plus the `data.*` fields that shape the records
(`train_files`, `val_files`, `prompt_key`, `negative_prompt_key`, `train/val_max_samples`, `max_prompt_length`)
and the tokenizer they were checked with; any other change leaves it valid.
"""

from __future__ import annotations

from typing import Any

from omniflow.tasks.cache_keys import key_of
from prefect import task

from omni_core.config.schema import DataConfig
from omni_core.data.datasets import dataset_files, load_datasets
from omni_core.data.prompts import PromptRecord

KEY_FIELDS = (
    "train_files",
    "val_files",
    "prompt_key",
    "negative_prompt_key",
    "train_max_samples",
    "val_max_samples",
    "max_prompt_length",
)


def _cache_key(context: Any, parameters: dict[str, Any]) -> str:
    data: DataConfig = parameters["data"]
    fields = {k: getattr(data, k) for k in KEY_FIELDS}
    fields["tokenizer"] = getattr(parameters["tokenizer"], "name_or_path", str(type(parameters["tokenizer"])))
    return key_of("dataset", dataset_files(data), fields)


@task(name="prepare_dataset", cache_key_fn=_cache_key, persist_result=True)
def prepare_dataset(data: DataConfig, tokenizer: Any) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """(train prompts, validation prompts), each checked against `data.max_prompt_length`."""
    return load_datasets(data, tokenizer)
