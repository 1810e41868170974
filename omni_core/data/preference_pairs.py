"""Offline preference pairs (offline Diffusion-DPO): pair files -> `PreferencePair`s, and a folder of image pairs ->
such a file.

The layout is verl-omni's offline DPO data set (`verl_omni/utils/dataset/offline_dpo_dataset.py`, written by its
`examples/dpo_trainer/data_process/prepare_offline_dpo.py`): one row per pair, in parquet, JSONL or JSON,

    prompt            the prompt (a string, or verl's chat messages: the user turn is the prompt)
    negative_prompt   optional, as for prompt files
    img_win           path of the chosen image (relative to the data file's folder, or absolute)
    img_lose          path of the rejected image
    win_score         optional, default 1.0 (must not be below lose_score)
    lose_score        optional, default 0.0
    data_source, extra_info   optional, as for prompt files

with the column names of `data.prompt_key`, `data.negative_prompt_key` and `data.{img_win,img_lose,win_score,
lose_score}_key`. verl-omni's files also carry its SD3 encoder outputs (`img_win_latents`, `prompt_embeds`, ...): they
are not read, because OmniFlow encodes the images with the run's own VAE and the prompts with its own text encoders
(both cached, `prepare_pair_latents` / `prepare_prompt_embeddings`), so a file written for another model can never
feed it latents of a different space.

`make_pair_dataset` writes such a parquet file from a folder holding `<name>_win.<ext>`, `<name>_lose.<ext>` and
`<name>.txt` (the prompt) per pair, with image paths relative to the file.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_core.data.prompts import PromptFileError, PromptRecord, _json_rows, _parquet_rows, _row_to_record, read_utf8
from omni_core.data_files import as_file_list, resolve_data_path

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
# The columns of verl-omni's files that hold its own encoder outputs (see the module docstring).
PRECOMPUTED_COLUMNS = (
    "img_win_latents",
    "img_lose_latents",
    "prompt_embeds",
    "prompt_embeds_mask",
    "pooled_prompt_embeds",
    "negative_prompt_embeds",
    "negative_prompt_embeds_mask",
    "negative_pooled_prompt_embeds",
)


@dataclass(frozen=True)
class PreferencePair(PromptRecord):
    """One prompt with a chosen and a rejected image (absolute paths) and their scores."""

    chosen_image: str = ""
    rejected_image: str = ""
    chosen_score: float = 1.0
    rejected_score: float = 0.0

    @property
    def images(self) -> tuple[str, str]:
        return self.chosen_image, self.rejected_image


def expand_pairs(pairs: list[PreferencePair]) -> list[tuple[PreferencePair, str, float]]:
    """verl-omni's `offline_dpo_collate_fn`: each pair as two adjacent samples, chosen then rejected, as
    (pair, image path, score)."""
    return [
        sample for pair in pairs for sample in ((pair, pair.chosen_image, pair.chosen_score), (pair, pair.rejected_image, pair.rejected_score))
    ]


# `data.custom_cls.collate_fn` -> how a batch of pairs becomes the step's samples (null: verl-omni's, the only one).
COLLATE_FNS = {"offline_dpo_collate_fn": expand_pairs}


def collate_fn(name: str | None):
    """The collate function `data.custom_cls.collate_fn` names (validation refuses any other name)."""
    if name is None:
        return expand_pairs
    if name not in COLLATE_FNS:
        raise ValueError(f"data.custom_cls.collate_fn={name!r}: not a collate function OmniFlow has ({', '.join(COLLATE_FNS)})")
    return COLLATE_FNS[name]


def load_preference_pairs(
    files: str | list[str] | tuple[str, ...],
    *,
    prompt_key: str = "prompt",
    negative_prompt_key: str = "negative_prompt",
    win_key: str = "img_win",
    lose_key: str = "img_lose",
    win_score_key: str = "win_score",
    lose_score_key: str = "lose_score",
    max_samples: int = -1,
) -> list[PreferencePair]:
    """Every pair of `files` in order (the first `max_samples`; -1: all). Errors name the file, the row and the fix:
    a missing column, a missing image, a chosen score below the rejected one."""
    paths = as_file_list(files)
    if not paths:
        raise PromptFileError("no pair files given; set data.train_files to a .parquet or .jsonl file of preference pairs")
    pairs: list[PreferencePair] = []
    for raw in paths:
        path = resolve_data_path(str(raw))
        suffix = path.suffix.lower()
        if suffix == ".txt":
            raise PromptFileError(
                f"{path}: a text file holds prompts, not preference pairs; offline Diffusion-DPO reads a .parquet, "
                f".jsonl or .json file with {prompt_key}, {win_key} and {lose_key} columns (`omniflow make-dataset "
                "--pairs FOLDER OUT.parquet` writes one)"
            )
        rows = _parquet_rows(path) if suffix == ".parquet" else _json_rows(path)
        count = 0
        for where, row in rows:
            pairs.append(
                _row_to_pair(
                    row, path, where, len(pairs), prompt_key, negative_prompt_key, win_key, lose_key, win_score_key, lose_score_key
                )
            )
            count += 1
            if 0 <= max_samples <= len(pairs):
                return pairs
        if count == 0:
            raise PromptFileError(f"{path}: no preference pairs (empty file); add rows or remove the file")
    return pairs


def pairs_of_config(files: str | list[str] | tuple[str, ...], data: Any, max_samples: int = -1) -> list[PreferencePair]:
    """`load_preference_pairs` with the column names of `data` (the `data` config section)."""
    return load_preference_pairs(
        files,
        prompt_key=data.prompt_key,
        negative_prompt_key=data.negative_prompt_key,
        win_key=data.img_win_key,
        lose_key=data.img_lose_key,
        win_score_key=data.win_score_key,
        lose_score_key=data.lose_score_key,
        max_samples=max_samples,
    )


def check_pair_file(path: Path, data: Any) -> int:
    """Check, cheaply and before anything starts, that `path` will load as preference pairs (`data`: the `data` config
    section); returns its number of pairs. A parquet file is read by its footer only (the prompt and image columns);
    JSON / JSONL files are read whole, images included. Raises `PromptFileError` naming the file and the fix."""
    if path.suffix.lower() != ".parquet":
        return len(pairs_of_config([str(path)], data))
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as exc:  # pyarrow raises several types for a truncated, corrupt or non-parquet file
        raise PromptFileError(f"{path}: not a readable parquet file ({exc}); rewrite it, e.g. with `omniflow make-dataset --pairs`") from exc
    columns = {meta.schema.column(i).path.split(".")[0] for i in range(meta.num_columns)}
    for key, setting in ((data.prompt_key, "prompt_key"), (data.img_win_key, "img_win_key"), (data.img_lose_key, "img_lose_key")):
        if key not in columns:
            raise PromptFileError(
                f"{path}: no {key!r} column (columns: {', '.join(sorted(columns)) or 'none'}); a preference-pair file needs "
                f"the prompt and both images' paths: set data.{setting} to the column that holds it"
            )
    if meta.num_rows == 0:
        raise PromptFileError(f"{path}: no preference pairs (empty file); add rows or remove the file")
    return meta.num_rows


def _row_to_pair(
    row: dict[str, Any],
    path: Path,
    where: str,
    index: int,
    prompt_key: str,
    negative_prompt_key: str,
    win_key: str,
    lose_key: str,
    win_score_key: str,
    lose_score_key: str,
) -> PreferencePair:
    record = _row_to_record(
        row, path=path, where=where, prompt_key=prompt_key, negative_prompt_key=negative_prompt_key, default_source="offline_dpo"
    )
    pair_columns = {*PRECOMPUTED_COLUMNS, win_key, lose_key, win_score_key, lose_score_key}
    record["extra_info"] = {k: v for k, v in record["extra_info"].items() if k not in pair_columns}
    images = []
    for key, setting in ((win_key, "img_win_key"), (lose_key, "img_lose_key")):
        value = row.get(key)
        if not isinstance(value, str) or not value:
            raise PromptFileError(
                f"{path}: {where}: no image path in column {key!r} (columns: {', '.join(sorted(row))}); every pair needs "
                f"its chosen and rejected image, or set data.{setting} to the column that holds it"
            )
        image = Path(os.path.expanduser(value))
        image = image if image.is_absolute() else path.parent / image
        if not image.is_file():
            raise PromptFileError(f"{path}: {where}: the {key} image {image} does not exist; fix the path (relative paths are read from {path.parent})")
        if image.suffix.lower() not in IMAGE_SUFFIXES:
            raise PromptFileError(f"{path}: {where}: {image} is not an image file ({', '.join(IMAGE_SUFFIXES)})")
        images.append(str(image.resolve()))
    scores = []
    for key, default in ((win_score_key, 1.0), (lose_score_key, 0.0)):
        value = row.get(key)
        try:
            score = default if value is None else float(value)
        except (TypeError, ValueError):
            raise PromptFileError(f"{path}: {where}: {key}={value!r} is not a number") from None
        if not math.isfinite(score):
            raise PromptFileError(f"{path}: {where}: {key}={value!r} is not finite")
        scores.append(score)
    if scores[0] < scores[1]:
        raise PromptFileError(
            f"{path}: {where}: {win_score_key}={scores[0]} is below {lose_score_key}={scores[1]}: the chosen image must "
            f"score at least the rejected one; swap {win_key} and {lose_key} in this row"
        )
    return PreferencePair(
        **record,
        index=index,
        chosen_image=images[0],
        rejected_image=images[1],
        chosen_score=scores[0],
        rejected_score=scores[1],
    )


def make_pair_dataset(folder: str | Path, out_path: str | Path, data_source: str = "offline_dpo") -> Path:
    """Write `out_path` (parquet, the layout of the module docstring) from `folder`'s pairs: for each `<name>.txt`
    (the prompt), the images `<name>_win.<ext>` and `<name>_lose.<ext>`, in name order. Image paths are stored relative
    to the output file's folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = Path(folder).expanduser()
    if not src.is_dir():
        raise PromptFileError(f"{src}: not a folder; make-dataset --pairs reads a folder of <name>.txt, <name>_win.png and <name>_lose.png")
    out = Path(out_path).expanduser().resolve()
    rows = []
    for prompt_file in sorted(src.glob("*.txt")):
        name = prompt_file.stem
        found = {}
        for side in ("win", "lose"):
            matches = [p for p in sorted(src.glob(f"{name}_{side}.*")) if p.suffix.lower() in IMAGE_SUFFIXES]
            if not matches:
                raise PromptFileError(f"{prompt_file}: no {name}_{side} image ({', '.join(IMAGE_SUFFIXES)}) beside it; add it or remove the prompt")
            found[side] = os.path.relpath(matches[0].resolve(), out.parent)
        prompt = read_utf8(prompt_file).strip()
        if not prompt:
            raise PromptFileError(f"{prompt_file}: empty prompt")
        rows.append(
            {
                "data_source": data_source,
                "prompt": [{"role": "user", "content": prompt}],
                "img_win": found["win"],
                "img_lose": found["lose"],
                "win_score": 1.0,
                "lose_score": 0.0,
                "extra_info": {"index": len(rows), "name": name},
            }
        )
    if not rows:
        raise PromptFileError(f"{src}: no pairs (no <name>.txt files with <name>_win and <name>_lose images)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp_{os.getpid()}")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, out)
    return out
