"""Where the set-up tasks keep their cached files, next to Prefect's results.

The keys themselves are `omni_core.cache_keys.key_of` (file fingerprints, config fields, code version). A
task whose result is a file (not a value Prefect stores) keeps it next to Prefect's results
(`cached_file`) and keys itself with `file_backed_key`, so that a deleted file is made again.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from prefect.settings import get_current_settings


def cached_file(kind: str, key: str, suffix: str) -> Path:
    """`<Prefect's local result storage>/omniflow-<kind>/<key><suffix>`: one path per cache key, kept as long as
    Prefect's cached results are (under PREFECT_HOME unless `PREFECT_RESULTS_LOCAL_STORAGE_PATH` says otherwise)."""
    return Path(get_current_settings().results.local_storage_path).expanduser() / f"omniflow-{kind}" / f"{key}{suffix}"


def file_backed_key(context: Any, key: str, file: Path) -> str:
    """`key`, unless Prefect holds a result under it whose `file` is gone: then a key never used before, so the
    task runs again and writes `file` back (the record under `key` then points at a file that exists again)."""
    if file.is_file() or not context.result_store.exists(key):
        return key
    return f"{key}-remake-{uuid.uuid4().hex[:8]}"
