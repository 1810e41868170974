"""Prompt-file contents: UTF-8 text, JSON rows with a prompt, a readable parquet footer with the prompt column (with
offline samples: the preference pairs' columns, `omni_core.data.preference_pairs.check_pair_file`).

The `paths` group checks that each file exists and has a supported suffix; this one opens the files that do,
as `prepare_dataset` would, so a bad file fails `omniflow validate` (in a second) rather than a task after Ray
and the TransferQueue started. Light: plain Python for text files, pyarrow's footer reader for parquet.
"""

from __future__ import annotations

from omni_core.config import ConfigProblem, OmniFlowConfig
from omni_core.data.preference_pairs import check_pair_file
from omni_core.data.prompts import PromptFileError, check_prompt_file
from omni_core.data_files import DataFileError, as_file_list, resolve_data_path


def data_file_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    p: list[ConfigProblem] = []
    data = config.data
    pairs = config.algorithm.sample_source == "offline"  # preference pairs; no validation set is read
    files = (("data.train_files", data.train_files),) if pairs else (("data.train_files", data.train_files), ("data.val_files", data.val_files))
    for key, value in files:
        for f in as_file_list(value):
            try:
                path = resolve_data_path(f)
            except DataFileError:
                continue  # missing or unsupported: reported by the paths group
            try:
                if pairs:
                    check_pair_file(path, data)
                else:
                    check_prompt_file(path, data.prompt_key, data.negative_prompt_key)
            except PromptFileError as exc:
                p.append(ConfigProblem(key, str(exc), f))
            except OSError as exc:  # unreadable (permissions, a folder named like a file)
                p.append(ConfigProblem(key, f"{path}: cannot be read ({exc}); check its permissions", f))
    return p
