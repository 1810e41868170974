"""Cache keys of the set-up tasks: file fingerprints plus the config fields each result depends on.

A key goes stale exactly when a file the task reads changes (its bytes, via sha256) or a config
field it reads changes; nothing else (not the run, not unrelated config) invalidates it.

A task whose result is a file (not a value Prefect stores) keeps it next to Prefect's results
(`cached_file`) and keys itself with `file_backed_key`, so that a deleted file is made again.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path
from typing import Any

from prefect.settings import get_current_settings


def fingerprint_files(paths: list[Path]) -> str:
    """sha256 over (relative name, bytes) of every file under `paths` (files or folders), sorted."""
    h = hashlib.sha256()
    for root in paths:
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        for f in files:
            h.update(str(f.relative_to(root) if root.is_dir() else f.name).encode())
            h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def key_of(kind: str, files: list[Path], fields: dict[str, Any]) -> str:
    payload = json.dumps(fields, sort_keys=True, default=str)
    return f"omniflow-{kind}-" + hashlib.sha256((fingerprint_files(files) + payload).encode()).hexdigest()[:32]


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
