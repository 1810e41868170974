"""Cache keys of the set-up tasks: file fingerprints plus the config fields each result depends on.

A key goes stale exactly when a file the task reads changes (its bytes, via sha256) or a config
field it reads changes; nothing else (not the run, not unrelated config) invalidates it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


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
