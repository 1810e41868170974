"""Model paths that name a Hugging Face Hub id: the one place that decides "local folder or Hub id" and returns the
local folder every loader opens.

A model path (``actor_rollout_ref.model.path``, ``tokenizer_path``, ``lora_adapter_path``, a model reward's
``model_path`` / ``processor_path``) is a local folder when one exists there (as before, whatever its name looks
like); otherwise, when it reads like a Hub id (``org/name``, as every verl-omni and flow_grpo recipe writes
``stabilityai/stable-diffusion-3.5-medium``), it is resolved with ``huggingface_hub.snapshot_download`` to its
snapshot folder in the standard Hugging Face cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``), at ``revision``
(a branch, tag or commit; None = ``main``). ``HF_HUB_OFFLINE=1`` (the CLI's default) reads the cache only: a
model that is not there is an error naming the key and the download command, never a network call.

The environment is read when a path is resolved, not when huggingface_hub was imported, so a process (or a Ray
worker) that sets ``HF_HUB_CACHE`` / ``HF_HUB_OFFLINE`` later is honoured. Every process resolves the same way:
on one machine the cache is shared; several nodes need the cache on shared storage (or the model downloaded on
each node first).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from omni_core.models.model_index import ModelLoadError

# `org/name`, as the Hub spells repo ids (letters, digits, '_', '-', '.'; no '--' or '..'). A bare `name` (the
# Hub's few legacy ids) is not taken for one: a missing relative folder `tiny` is a local path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
# A diffusers pipeline needs model_index.json and its component folders; the top level of a Hub repo also holds
# single-file checkpoints (sd3.5_medium.safetensors, several GB), images and READMEs that from_pretrained never
# reads. fnmatch's `*` crosses '/', so "*/*" is every file in a sub-folder.
PIPELINE_FILES = ["model_index.json", "*/*"]
# A transformers model (a CLIP reward): everything but the weights of other frameworks.
TRANSFORMERS_SKIP = ["*.msgpack", "*.h5", "*.ot", "*.onnx", "flax_model*", "tf_model*", "rust_model*"]
_TRUE = {"1", "ON", "YES", "TRUE"}


class HubModelError(ModelLoadError):
    """A Hub id that could not be resolved to a local folder; ``reason`` says what is missing and how to get it."""

    def __init__(self, key: str, repo_id: str, reason: str):
        self.key, self.repo_id, self.reason = key, repo_id, reason
        super().__init__(f"{key}={repo_id}: {reason}")


def looks_like_hub_id(path: str | Path | None) -> bool:
    """Whether ``path`` is spelled like a Hub id (``org/name``), whatever exists on disk."""
    text = str(path or "")
    return bool(_HUB_ID.match(text)) and ".." not in text and "--" not in text and not text.endswith(".git")


def is_hub_id(path: str | Path | None) -> bool:
    """Whether ``path`` names a Hub id: spelled ``org/name`` and no local file or folder of that name exists."""
    return looks_like_hub_id(path) and not Path(str(path)).expanduser().exists()


def hub_offline() -> bool:
    """Whether downloads are off: ``HF_HUB_OFFLINE`` (else ``TRANSFORMERS_OFFLINE``) as set now, as huggingface_hub
    reads them."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache as set now: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else huggingface_hub's default."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(os.path.expandvars(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"])).expanduser()
    if env.get("HF_HOME"):
        return Path(os.path.expandvars(env["HF_HOME"])).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def download_command(repo_id: str, revision: str | None) -> str:
    """The shell command that puts ``repo_id`` at ``revision`` into the cache."""
    return f"hf download {repo_id} --revision {revision or 'main'}"


def _why(err: Exception, repo_id: str, revision: str | None, key: str, cache: Path, offline: bool) -> str:
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"at revision {revision or 'main'}"
    get = (
        f"download it first with `{download_command(repo_id, revision)}` (or `huggingface-cli download ...`, same "
        f"arguments) with the HF_HOME / HF_HUB_CACHE this run uses"
    )
    local = f" (there is no local folder {repo_id} either)"
    rev_key = f"{key.rsplit('.', 1)[0]}.revision" if key.endswith(".path") else "revision"
    if isinstance(err, IncompleteSnapshotError):
        return f"the cached snapshot of this Hugging Face Hub model {at} in {cache} is incomplete ({err}); {get}"
    if isinstance(err, GatedRepoError):
        return (
            f"this Hugging Face Hub model is gated: accept its licence on https://huggingface.co/{repo_id} and log in "
            f"(`hf auth login`, or set HF_TOKEN), then run again or {get}"
        )
    if isinstance(err, RevisionNotFoundError):
        return f"the Hugging Face Hub has no revision {revision or 'main'} of this model; check {rev_key}"
    if isinstance(err, RepositoryNotFoundError):
        return (
            f"no such model on the Hugging Face Hub{local}; check the id, or log in (`hf auth login`, or set "
            f"HF_TOKEN) if it is private, or point {key} at a local diffusers folder"
        )
    if isinstance(err, LocalEntryNotFoundError) and offline:
        return (
            f"this Hugging Face Hub model {at} is not in the Hugging Face cache {cache}{local}, and HF_HUB_OFFLINE=1 "
            f"keeps the run from downloading it: {get}, or set HF_HUB_OFFLINE=0 to let the run download it"
        )
    if isinstance(err, HfHubHTTPError):  # the Hub answered with another error (5xx, 401 ...)
        return f"the Hugging Face Hub refused this model {at} ({type(err).__name__}: {err}); {get}"
    # the Hub could not be reached (DNS, connection, timeout): httpx's errors, or huggingface_hub's wrapping of them
    return (
        f"the Hugging Face Hub could not be reached ({type(err).__name__}: {err}) and this model {at} is not in the "
        f"Hugging Face cache {cache}{local}: {get} on a machine with network, or point {key} at a local folder"
    )


def _snapshot(repo_id: str, revision: str | None, local_only: bool, patterns: list[str] | None, skip: list[str] | None) -> str:
    from huggingface_hub import snapshot_download

    if patterns is None and skip is None:
        patterns = PIPELINE_FILES
    return snapshot_download(
        repo_id,
        revision=revision,
        cache_dir=hub_cache_dir(),
        local_files_only=local_only,
        allow_patterns=patterns,
        ignore_patterns=skip,
    )


def resolve_model_path(
    path: str | Path,
    revision: str | None = None,
    *,
    key: str = "actor_rollout_ref.model.path",
    patterns: list[str] | None = None,
    skip: list[str] | None = None,
    download: bool = True,
) -> Path:
    """The local folder of the model at ``path``: ``path`` itself (expanded) unless it is a Hub id (``is_hub_id``),
    else that model's snapshot folder in the Hugging Face cache at ``revision``, downloaded first when
    ``HF_HUB_OFFLINE`` allows. ``patterns`` / ``skip`` choose the files (default: a diffusers pipeline's,
    ``PIPELINE_FILES``; a transformers model passes ``skip=TRANSFORMERS_SKIP``). ``download=False`` reads the
    cache only, whatever ``HF_HUB_OFFLINE`` says (what checks before a run use).

    Raises ``HubModelError`` naming ``key``, what is missing and the command that gets it. Resolving a local folder
    (or an already resolved snapshot folder) returns it unchanged, so callers may resolve again."""
    if not is_hub_id(path):
        return Path(path).expanduser()
    repo_id, offline = str(path), hub_offline()
    try:
        return Path(_snapshot(repo_id, revision, offline or not download, patterns, skip))
    except (OSError, ValueError) as err:  # huggingface_hub's errors are OSError (HTTPError) or ValueError subclasses
        raise HubModelError(key, repo_id, _why(err, repo_id, revision, key, hub_cache_dir(), offline)) from err


def model_folder(model) -> Path:
    """The local pipeline folder of an ``actor_rollout_ref.model`` section: its ``path``, or the Hub id ``path`` at
    ``revision`` in the Hugging Face cache."""
    return resolve_model_path(model.path, model.revision)


def hub_problem(
    path: str | Path | None,
    revision: str | None,
    key: str,
    *,
    patterns: list[str] | None = None,
    skip: list[str] | None = None,
) -> str | None:
    """Why the Hub id at ``key`` cannot be loaded, or None (also for a local path: its own checks decide).

    Checked before anything starts and without downloading: the cache must hold the snapshot; online, a model not
    cached yet is looked up on the Hub instead (the run downloads it when it first loads it), so a wrong id or
    revision, or a gated model, fails here too."""
    if not is_hub_id(path):
        return None
    from huggingface_hub import HfApi
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo_id, offline = str(path), hub_offline()
    try:
        try:
            _snapshot(repo_id, revision, True, patterns, skip)
        except LocalEntryNotFoundError:
            if offline:
                raise
            HfApi().repo_info(repo_id, revision=revision, repo_type="model")
    except Exception as err:  # online: also httpx's connection errors
        return _why(err, repo_id, revision, key, hub_cache_dir(), offline)
    return None


def hub_snapshot(path: str | Path | None, revision: str | None = None, **files: list[str] | None) -> str | None:
    """The commit of the snapshot a Hub id resolves to (its folder's name), or None for a local path: what a cache
    key of a value read from the model holds, so another revision is never served from an older one's entry."""
    if not is_hub_id(path):
        return None
    return resolve_model_path(str(path), revision, **files).name


def shadowed_hub_model(target: str | Path) -> str | None:
    """Why writing a local folder at ``target`` would hide a real Hub model, or None.

    A relative ``org/name`` with no folder there yet is refused when the Hub id is a model: in the Hugging Face
    cache, or (with downloads on) on the Hub. A run given that id would load the local folder instead (a local
    folder wins), so a random tiny model would quietly stand in for the real one. Any other folder is fine."""
    if not is_hub_id(target):
        return None
    repo_id = str(target)
    if hub_problem(repo_id, None, "target", skip=TRANSFORMERS_SKIP) is not None:
        return None  # not a model this machine knows of: an ordinary local folder such as models/tiny-sd3
    name = repo_id.split("/")[1]
    where = f"in the Hugging Face cache {hub_cache_dir()}" if hub_offline() else "on the Hugging Face Hub"
    return (
        f"{repo_id} is the Hugging Face Hub id of a model ({where}); a tiny random model written to the local folder "
        f"{repo_id} would be loaded instead of it wherever a model path says {repo_id} (a local folder wins over a Hub "
        f"id). To train the real model, name the Hub id in actor_rollout_ref.model.path (download it with "
        f"`{download_command(repo_id, None)}`); to build the tiny model, choose another folder, e.g. models/tiny-{name}"
    )
