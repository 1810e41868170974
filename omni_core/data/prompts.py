"""Prompt files -> `PromptRecord`s: verl parquet, JSONL / JSON, and plain text.

A verl-omni parquet row is `{data_source, prompt: [{role, content}], ability, reward_model: {style,
ground_truth}, extra_info}` (verl-omni `examples/flowgrpo_trainer/data_process/sd3_ocr.py`); JSONL rows use
the same fields. The prompt column may also hold a plain string. A row without `extra_info` (flow_grpo's
GenEval-style metadata, `{"tag", "include", "exclude", "prompt"}`) keeps its other fields as the record's
`extra_info`, which reward functions receive (`omni_core/assets/prompts/geneval_style.jsonl` is such a file).
Text files hold one prompt per line; blank lines and `#` comments are skipped. Every error names the file (and the row or line) and the fix.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_core.data_files import DataFileError, resolve_data_path


class PromptFileError(DataFileError):
    """A prompt file whose contents cannot be read as prompts (names the file, the row and the fix)."""


@dataclass(frozen=True)
class PromptRecord:
    """One training / validation prompt.

    `index` is the position in the loaded list (0..N-1 over all files, in file order), stable for the same
    files and `max_samples`, so prompt uids can be derived from (seed, step, index) instead of uuid4.
    """

    prompt: str
    negative_prompt: str | None = None
    data_source: str = "jpeg_compressibility"
    ground_truth: Any = None
    extra_info: dict[str, Any] = field(default_factory=dict)
    index: int = 0


def load_prompts(
    files: str | Path | Iterable[str | Path],
    *,
    prompt_key: str = "prompt",
    negative_prompt_key: str = "negative_prompt",
    max_samples: int = -1,
    default_data_source: str = "jpeg_compressibility",
) -> list[PromptRecord]:
    """Read every file (plain or `pkg://` path) in order; keep the first `max_samples` prompts (-1: all)."""
    paths = [files] if isinstance(files, str | Path) else list(files)
    if not paths:
        raise PromptFileError("no prompt files given; set data.train_files to a .parquet, .jsonl or .txt file")
    records: list[PromptRecord] = []
    for raw_path in paths:
        path = resolve_data_path(str(raw_path))
        count = 0
        for rec in _read_file(path, prompt_key, negative_prompt_key, default_data_source):
            records.append(PromptRecord(**rec, index=len(records)))
            count += 1
            if 0 <= max_samples <= len(records):
                return records
        if count == 0:
            raise PromptFileError(f"{path}: no prompts (empty file); add at least one prompt or remove the file")
    return records


def _read_file(path: Path, prompt_key: str, negative_prompt_key: str, default_source: str) -> Iterator[dict[str, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".txt":
        for line in read_text_prompts(path):
            yield {"prompt": line, "data_source": default_source}
        return
    rows = _parquet_rows(path) if suffix == ".parquet" else _json_rows(path)
    for where, row in rows:
        yield _row_to_record(
            row,
            path=path,
            where=where,
            prompt_key=prompt_key,
            negative_prompt_key=negative_prompt_key,
            default_source=default_source,
        )


def read_text_prompts(path: Path) -> Iterator[str]:
    """Prompts of a text file: one per line, stripped; blank lines and `#` comments skipped."""
    for line in read_utf8(path).splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            yield line


def read_utf8(path: Path) -> str:
    """The text of a prompt file; bytes that are not UTF-8 are an error naming the file, the line and the fix."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise PromptFileError(
            f"{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}, line {line}); save the file "
            f"as UTF-8, e.g. `iconv -f latin1 -t utf-8 {path.name} > fixed{path.suffix}`"
        ) from exc


def check_prompt_file(path: Path, prompt_key: str = "prompt", negative_prompt_key: str = "negative_prompt") -> int:
    """Check that `path` will load, cheaply, before anything expensive starts; returns its number of prompts.

    Text, JSON and JSONL files are read whole (UTF-8, JSON syntax, the prompt field of every row); a parquet
    file only by its footer (readable, has rows and a `prompt_key` column), so a large dataset costs a few kB.
    Raises `PromptFileError` naming the file and the fix.
    """
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq  # only when a parquet file is configured

        try:
            meta = pq.ParquetFile(path).metadata
        except Exception as exc:  # pyarrow raises several types for a truncated, corrupt or non-parquet file
            raise PromptFileError(
                f"{path}: not a readable parquet file ({exc}); rewrite it, e.g. with `omniflow make-dataset`"
            ) from exc
        columns = {meta.schema.column(i).path.split(".")[0] for i in range(meta.num_columns)}
        if prompt_key not in columns:
            raise PromptFileError(
                f"{path}: no {prompt_key!r} column (columns: {', '.join(sorted(columns)) or 'none'}); "
                f"set data.prompt_key to the column that holds the prompt"
            )
        count = meta.num_rows
    else:
        count = sum(1 for _ in _read_file(path, prompt_key, negative_prompt_key, ""))
    if count == 0:
        raise PromptFileError(f"{path}: no prompts (empty file); add at least one prompt or remove the file")
    return count


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow.parquet as pq  # imported here: text-only runs never pay for pyarrow

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a corrupt or non-parquet file
        raise PromptFileError(f"{path}: not a readable parquet file ({exc})") from exc
    for i, row in enumerate(table.to_pylist()):
        yield f"row {i}", row


def _json_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    text = read_utf8(path)
    if path.suffix.lower() == ".json":
        # A .json file holds one list of row objects (what `json.dump(rows)` writes).
        try:
            rows = json.loads(text) if text.strip() else []
        except json.JSONDecodeError as exc:
            raise PromptFileError(f"{path}: invalid JSON at line {exc.lineno} ({exc.msg})") from exc
        if not isinstance(rows, list):
            raise PromptFileError(f"{path}: a .json prompt file must hold a list of objects; use .jsonl for one object per line")
        for i, row in enumerate(rows):
            yield f"row {i}", _require_object(row, path, f"row {i}")
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptFileError(f"{path}: line {lineno}: invalid JSON ({exc.msg}); each line must be one JSON object") from exc
        yield f"line {lineno}", _require_object(row, path, f"line {lineno}")


def _require_object(row: Any, path: Path, where: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise PromptFileError(f"{path}: {where}: expected a JSON object with a prompt field, got {type(row).__name__}")
    return row


def _row_to_record(
    row: dict[str, Any], *, path: Path, where: str, prompt_key: str, negative_prompt_key: str, default_source: str
) -> dict[str, Any]:
    if prompt_key not in row:
        raise PromptFileError(
            f"{path}: {where}: no {prompt_key!r} column (columns: {', '.join(sorted(row)) or 'none'}); "
            f"set data.prompt_key to the column that holds the prompt"
        )
    prompt = _prompt_text(row[prompt_key], path=path, where=where, key=prompt_key)
    if prompt is None or not prompt.strip():
        raise PromptFileError(f"{path}: {where}: empty {prompt_key!r}; every row needs a prompt")
    negative = row.get(negative_prompt_key)
    negative = None if negative is None else _prompt_text(negative, path=path, where=where, key=negative_prompt_key)
    reward_model = row.get("reward_model")
    extra_info = row.get("extra_info")
    if isinstance(extra_info, dict):  # verl's layout: its extra_info column
        info = dict(extra_info)
    else:  # flow_grpo / GenEval metadata rows ({"tag", "include", ..., "prompt"}): their other fields are the metadata
        known = {prompt_key, negative_prompt_key, "data_source", "reward_model", "extra_info"}
        info = {k: v for k, v in row.items() if k not in known and v is not None}
    return {
        "prompt": prompt,
        "negative_prompt": negative or None,
        "data_source": row.get("data_source") or default_source,
        "ground_truth": reward_model.get("ground_truth") if isinstance(reward_model, dict) else None,
        "extra_info": info,
    }


def _prompt_text(value: Any, *, path: Path, where: str, key: str) -> str | None:
    """A prompt cell as text: a string, or the user message of a chat (verl's layout)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        users = [m for m in value if isinstance(m, dict) and m.get("role") == "user"]
        if not users:
            raise PromptFileError(
                f"{path}: {where}: {key!r} is a chat without a user message; expected [{{'role': 'user', 'content': '...'}}]"
            )
        # Text-to-image chats carry one user turn; if several, the last is the one a generator answers.
        return _content_text(users[-1].get("content"), path=path, where=where, key=key)
    raise PromptFileError(f"{path}: {where}: {key!r} must be a string or a list of chat messages, got {type(value).__name__}")


def _content_text(content: Any, *, path: Path, where: str, key: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multimodal chat content: [{"type": "text", "text": ...}, ...]
        parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text"]
        return " ".join(p for p in parts if p)
    raise PromptFileError(f"{path}: {where}: the user message of {key!r} has no text content")
