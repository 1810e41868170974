"""Where prompt files live: plain paths, and `pkg://` paths to files shipped inside OmniFlow.

`pkg://omni_core/assets/prompts/train.txt` names a file inside the installed package (as verl's
`pkg://` module paths do), so the default config works from any working directory.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

PKG_PREFIX = "pkg://"
SUPPORTED_SUFFIXES = (".parquet", ".jsonl", ".json", ".txt")


class DataFileError(ValueError):
    """A prompt file that is missing or of an unsupported kind."""


def as_file_list(value: str | tuple[str, ...] | list[str] | None) -> list[str]:
    """`data.train_files` / `data.val_files` (one path, a list, or null) as a list of paths."""
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def resolve_data_path(path: str) -> Path:
    """A local `Path` for `path` (plain or `pkg://package/relative/file`); errors name the path and the fix."""
    if path.startswith(PKG_PREFIX):
        package, _, rel = path[len(PKG_PREFIX) :].partition("/")
        try:
            resolved = Path(str(resources.files(package).joinpath(rel)))
        except ModuleNotFoundError as exc:
            raise DataFileError(f"{path}: package {package!r} is not installed") from exc
    else:
        resolved = Path(path).expanduser()
    if not resolved.is_file():
        raise DataFileError(f"prompt file not found: {resolved}; pass an existing .parquet, .jsonl or .txt file")
    if resolved.suffix.lower() not in SUPPORTED_SUFFIXES:
        raise DataFileError(
            f"{resolved}: unsupported prompt file type {resolved.suffix!r}; use one of {', '.join(SUPPORTED_SUFFIXES)}"
        )
    return resolved
