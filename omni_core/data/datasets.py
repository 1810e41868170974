"""The run's prompt datasets: `data.train_files` / `data.val_files` read into `PromptRecord`s and
checked against the tokenizer (verl-omni's `_init_dataloader()` datasets, `truncation: error`).

`prepare_dataset` (a cached Prefect task) calls `load_datasets`; `dataset_files` names the files its
cache key fingerprints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omni_core.config.schema import DataConfig
from omni_core.data.preference_pairs import pairs_of_config
from omni_core.data.prompts import PromptRecord, load_prompts
from omni_core.data_files import as_file_list, resolve_data_path


def dataset_files(data: DataConfig) -> list[Path]:
    """Every prompt file the datasets read (training, then validation), resolved to local paths."""
    return [resolve_data_path(f) for f in as_file_list(data.train_files) + as_file_list(data.val_files)]


def check_prompt_lengths(records: list[PromptRecord], tokenizer: Any, max_len: int, key: str) -> None:
    """verl's `truncation: error`: a prompt longer than data.max_prompt_length tokens is an error."""
    for r in records:
        n = len(tokenizer(r.prompt)["input_ids"])
        if n > max_len:
            raise ValueError(
                f"{key}: prompt {r.index} has {n} tokens, more than data.max_prompt_length={max_len}: {r.prompt[:80]!r}; "
                f"shorten it or raise data.max_prompt_length"
            )


def load_datasets(data: DataConfig, tokenizer: Any, pairs: bool = False) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """(train prompts, validation prompts; empty without `data.val_files`), each checked against
    `data.max_prompt_length` tokens of `tokenizer`. `pairs` (offline samples, `algorithm.sample_source=offline`): the
    training files hold preference pairs (`omni_core.data.preference_pairs`), the records are `PreferencePair`s, and
    there is no validation set (an offline run samples no images to score; validation refuses the keys that ask for
    one), so `data.val_files` is not read."""

    def load(files: str | tuple[str, ...] | None, max_samples: int) -> list[PromptRecord]:
        if pairs:
            return list(pairs_of_config(as_file_list(files), data, max_samples))
        return load_prompts(
            as_file_list(files),
            prompt_key=data.prompt_key,
            negative_prompt_key=data.negative_prompt_key,
            max_samples=max_samples,
        )

    train = load(data.train_files, data.train_max_samples)
    val = load(data.val_files, data.val_max_samples) if data.val_files and not pairs else []
    check_prompt_lengths(train, tokenizer, data.max_prompt_length, "data.train_files")
    check_prompt_lengths(val, tokenizer, data.max_prompt_length, "data.val_files")
    return train, val
