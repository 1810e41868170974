"""Cache keys of the set-up tasks: file fingerprints plus the config fields each result depends on.

A key goes stale exactly when a file the task reads changes (its bytes, via sha256) or a config
field it reads changes; nothing else (not the run, not unrelated config) invalidates it.

Every key also carries the OmniFlow code that made the value (`code_version`): the installed package
version plus a hash of the `omni_core` source files that shape that kind of value (`CODE_FILES`). The
version alone would not do, since an editable install keeps one version number across commits; the hash
alone would miss a release that changes a dependency pin. An upgrade (or a local edit of, say, the prompt
parser) therefore makes a fresh value instead of reusing records an older OmniFlow wrote.

A task whose result is a file (not a value Prefect stores) keeps it next to Prefect's results
(`cached_file`) and keys itself with `file_backed_key`, so that a deleted file is made again.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import uuid
from pathlib import Path
from typing import Any

from prefect.settings import get_current_settings

import omni_core

OMNI_CORE_DIR = Path(omni_core.__file__).parent
# The omni_core modules whose code decides each cached value (paths relative to omni_core/). Only these:
# a change to training code must not throw away a dataset or embeddings that it cannot have changed.
CODE_FILES: dict[str, tuple[str, ...]] = {
    # AutoTokenizer's folder lookup (model.tokenizer_path, tokenizer/, the model folder).
    "tokenizer": ("models/tokenizer.py",),
    # Prompt-file parsing into PromptRecords (the record type itself, pkg:// paths, the length check).
    "dataset": ("data/prompts.py", "data/datasets.py", "data_files.py"),
    # Text-encoder loading and each architecture's encode(): they decide the embeddings' values.
    "prompt-embeddings": ("models/prompt_embeddings.py", "models/arch.py", "models/loader.py"),
}


def omniflow_version() -> str:
    """The installed package's version (`importlib.metadata`), or "unknown" when it is not installed."""
    try:
        return importlib.metadata.version("omniflow")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@functools.cache
def _source_hash(kind: str) -> str:
    # sha256 of the module sources of CODE_FILES[kind]; once per process (they do not change under a run).
    return fingerprint_files([OMNI_CORE_DIR / f for f in CODE_FILES.get(kind, ())])[:16]


def code_version(kind: str, version: str | None = None) -> str:
    """`<OmniFlow version>+<hash of kind's omni_core sources>`; `version` stands in for the installed one."""
    return f"{version if version is not None else omniflow_version()}+{_source_hash(kind)}"


def fingerprint_files(paths: list[Path]) -> str:
    """sha256 over (relative name, bytes) of every file under `paths` (files or folders), sorted."""
    h = hashlib.sha256()
    for root in paths:
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        for f in files:
            h.update(str(f.relative_to(root) if root.is_dir() else f.name).encode())
            h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def key_of(kind: str, files: list[Path], fields: dict[str, Any], version: str | None = None) -> str:
    """`omniflow-<kind>-<hash>` of `files`' fingerprint, `fields` and the code version (`code_version(kind, version)`)."""
    payload = json.dumps({**fields, "omniflow": code_version(kind, version)}, sort_keys=True, default=str)
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
