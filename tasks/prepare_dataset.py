"""Stage 4b — `prepare_dataset`: verl-omni's `_init_dataloader()` datasets (train and val prompts),
cached across runs.

Cache key: the sha256 of the prompt files, plus the data fields that shape the result
(`prompt_key`, `negative_prompt_key`, `train/val_max_samples`, `max_prompt_length`) and the tokenizer
it was checked with.
"""

from __future__ import annotations

from typing import Any

from omniflow.tasks.cache_keys import key_of
from prefect import task

from omni_core.config.schema import DataConfig
from omni_core.data.prompts import PromptRecord, load_prompts
from omni_core.data_files import resolve_data_path


def _files(value: str | tuple[str, ...] | None) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def _cache_key(context: Any, parameters: dict[str, Any]) -> str:
    data: DataConfig = parameters["data"]
    files = [resolve_data_path(f) for f in _files(data.train_files) + _files(data.val_files)]
    fields = {
        k: getattr(data, k)
        for k in (
            "train_files",
            "val_files",
            "prompt_key",
            "negative_prompt_key",
            "train_max_samples",
            "val_max_samples",
            "max_prompt_length",
        )
    }
    fields["tokenizer"] = getattr(parameters["tokenizer"], "name_or_path", str(type(parameters["tokenizer"])))
    return key_of("dataset", files, fields)


def check_prompt_lengths(records: list[PromptRecord], tokenizer: Any, max_len: int, key: str) -> None:
    """verl's `truncation: error`: a prompt longer than data.max_prompt_length tokens is an error."""
    for r in records:
        n = len(tokenizer(r.prompt)["input_ids"])
        if n > max_len:
            raise ValueError(
                f"{key}: prompt {r.index} has {n} tokens, more than data.max_prompt_length={max_len}: {r.prompt[:80]!r}; "
                f"shorten it or raise data.max_prompt_length"
            )


@task(name="prepare_dataset", cache_key_fn=_cache_key, persist_result=True)
def prepare_dataset(data: DataConfig, tokenizer: Any) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """(train prompts, validation prompts), each checked against `data.max_prompt_length`."""
    train = load_prompts(
        _files(data.train_files),
        prompt_key=data.prompt_key,
        negative_prompt_key=data.negative_prompt_key,
        max_samples=data.train_max_samples,
    )
    val = (
        load_prompts(
            _files(data.val_files),
            prompt_key=data.prompt_key,
            negative_prompt_key=data.negative_prompt_key,
            max_samples=data.val_max_samples,
        )
        if data.val_files
        else []
    )
    check_prompt_lengths(train, tokenizer, data.max_prompt_length, "data.train_files")
    check_prompt_lengths(val, tokenizer, data.max_prompt_length, "data.val_files")
    return train, val
