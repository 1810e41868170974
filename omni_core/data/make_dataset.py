"""Text file -> verl-layout parquet, the format verl-omni's data_process scripts write.

Each row: `{data_source, prompt: [{role: user, content}], ability: "image_generation",
reward_model: {style: "rule", ground_truth: ""}, extra_info: {split, index}}`, so a file made here also
loads in verl-omni, and `load_prompts` reads it back to the same prompts.
"""

from __future__ import annotations

import os
from pathlib import Path

from omni_core.data.prompts import PromptFileError, read_text_prompts
from omni_core.data_files import resolve_data_path


def make_dataset(
    text_file: str | Path, out_path: str | Path, data_source: str = "jpeg_compressibility", split: str | None = None
) -> Path:
    """Write `out_path` (parquet) from a text file of prompts; `split` defaults to the text file's stem."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = resolve_data_path(str(text_file))
    if src.suffix.lower() != ".txt":
        raise PromptFileError(f"{src}: make_dataset reads a .txt file with one prompt per line")
    prompts = list(read_text_prompts(src))
    if not prompts:
        raise PromptFileError(f"{src}: no prompts (empty file); add one prompt per line")
    split = split or src.stem
    rows = [
        {
            "data_source": data_source,
            "prompt": [{"role": "user", "content": text}],
            "ability": "image_generation",
            "reward_model": {"style": "rule", "ground_truth": ""},
            "extra_info": {"split": split, "index": i},
        }
        for i, text in enumerate(prompts)
    ]
    out = Path(out_path).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename, so a cached dataset task never sees a half-written file.
    tmp = out.with_name(f".{out.name}.tmp_{os.getpid()}")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, out)
    return out
