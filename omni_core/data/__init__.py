"""Prompt data: loading prompt files into `PromptRecord`s, writing verl-layout parquet, and the resumable loader.

Mirrors verl-omni's `_init_dataloader` (RLHFDataset + StatefulDataLoader) without a tokenizer: prompts stay
raw text here; the chat template and tokenisation happen later, on the rollout side.
"""

from omni_core.data.dataloader import PromptDataLoader
from omni_core.data.make_dataset import make_dataset
from omni_core.data.prompts import PromptFileError, PromptRecord, load_prompts

__all__ = ["PromptDataLoader", "PromptFileError", "PromptRecord", "load_prompts", "make_dataset"]
