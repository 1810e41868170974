"""Prompt data, one module each: prompt files into `PromptRecord`s (`prompts`, plain Python), the run's
train / val datasets checked against the tokenizer (`datasets`), the resumable loader (`dataloader`) and
writing the verl parquet layout (`make_dataset`).

Mirrors verl-omni's `_init_dataloader` (RLHFDataset + StatefulDataLoader) without a tokenizer in the
loop: prompts stay raw text here; the text encoders see them on the rollout side. Import from the
submodules; the package itself imports nothing, so `PromptRecord` stays light.
"""
