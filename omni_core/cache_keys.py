"""Cache keys of the set-up values: file fingerprints plus the config fields each value depends on.

A key goes stale exactly when a file the value is made from changes (its bytes, via sha256) or a config
field it reads changes; nothing else (not the run, not unrelated config) invalidates it.

Every key also carries the OmniFlow code that made the value (`code_version`): the installed package
version plus a hash of the `omni_core` source files that shape that kind of value (`CODE_FILES`). The
version alone would not do, since an editable install keeps one version number across commits; the hash
alone would miss a release that changes a dependency pin. An upgrade (or a local edit of, say, the prompt
parser) therefore makes a fresh value instead of reusing records an older OmniFlow wrote.

Plain hashing, no Prefect: the set-up tasks (`omniflow.tasks.cache_keys`) turn these keys into Prefect
cache keys and result-file paths.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
from pathlib import Path
from typing import Any

OMNI_CORE_DIR = Path(__file__).parent
# The omni_core modules whose code decides each cached value (paths relative to omni_core/). Only these:
# a change to training code must not throw away a dataset or embeddings that it cannot have changed.
CODE_FILES: dict[str, tuple[str, ...]] = {
    # AutoTokenizer's folder lookup (model.tokenizer_path, tokenizer/, the model folder).
    "tokenizer": ("models/tokenizer.py",),
    # Prompt-file parsing into PromptRecords (the record type itself, pkg:// paths, the length check).
    "dataset": ("data/prompts.py", "data/datasets.py", "data/preference_pairs.py", "data_files.py"),
    # Text-encoder loading and each architecture's encode(): they decide the embeddings' values.
    "prompt-embeddings": ("models/prompt_embeddings.py", "models/arch.py", "models/loader.py"),
    # Image loading, resizing and each architecture's encode_images(): they decide the offline pairs' latents.
    "pair-latents": ("models/pair_latents.py", "models/arch.py", "models/loader.py"),
}


DISTRIBUTION = "omniflow-rl"  # the name pip installs OmniFlow under (pyproject.toml); imports and the command: omniflow


def omniflow_version() -> str:
    """The installed package's version (`importlib.metadata`), or "unknown" when it is not installed."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
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
