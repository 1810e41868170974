"""Load a saved diffusers pipeline from a local directory (or a Hugging Face Hub id, resolved to its folder in the
Hugging Face cache by ``hub.resolve_model_path``), the one way OmniFlow loads models.

Owns: architecture resolution (``model_index.json``'s ``_class_name`` or an explicit name, checked against
``architectures.ARCHITECTURES``), clear errors (``ModelLoadError``) that name the path and the problem, and
freezing of everything that is not trained (text encoders, VAE). The transformer is left as loaded;
``FlowPolicy`` decides what in it is trainable.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from diffusers import DiffusionPipeline

from omni_core.models.architectures import BY_PIPELINE, architecture_choices, find_architecture
from omni_core.models.hub import resolve_model_path
from omni_core.models.model_index import ModelLoadError, read_model_index
from omni_core.quiet import quiet_model_libraries

quiet_model_libraries()  # no progress bars while every actor loads its pipeline


def resolve_architecture(architecture: str) -> str:
    """Map a short name of ``ARCHITECTURES`` (``"sd3"``, ...) or a pipeline class name to the supported pipeline
    class name."""
    entry = find_architecture(architecture)
    if entry is None:
        raise ModelLoadError(f"unsupported architecture {architecture!r}; supported: {architecture_choices()}")
    return entry.pipeline


def check_pipeline_folder(path: str | Path, architecture: str | None = None) -> str:
    """The supported pipeline class saved in ``path``, after checking the folder the way loading needs it.

    ``architecture`` (a short name of ``ARCHITECTURES``, a pipeline class name, or None / ``"auto"`` to read
    ``model_index.json``) must agree with the saved ``_class_name`` when both are given; every component
    folder listed in ``model_index.json`` must exist. Raises ``ModelLoadError`` naming the path.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"model path {path} is not a directory")
    index = read_model_index(path)
    saved = index.get("_class_name")
    if architecture is None or architecture.lower() == "auto":
        if saved is None:
            raise ModelLoadError(f"{path / 'model_index.json'} has no _class_name; pass the architecture explicitly")
        name = resolve_architecture(saved)
    else:
        name = resolve_architecture(architecture)
        if saved is not None and saved != name:
            raise ModelLoadError(
                f"{path}: architecture={architecture!r} ({name}) does not match model_index.json _class_name={saved!r}"
            )
    _check_components(path, index)
    return name


def _check_components(path: Path, index: dict) -> None:
    # Entries like "vae": ["diffusers", "AutoencoderKL"] are components saved in a sub-folder;
    # [null, null] marks an optional component that is absent on purpose.
    missing = [
        name
        for name, value in index.items()
        if not name.startswith("_") and isinstance(value, list) and value[0] is not None and not (path / name).is_dir()
    ]
    if missing:
        raise ModelLoadError(f"{path}: component folder(s) missing: {missing} (listed in model_index.json)")


def absent_components(path: str | Path) -> dict[str, None]:
    """Components that ``model_index.json`` lists as absent on purpose (``[null, null]``, e.g. the VAE of a pixel-space
    model), as ``{name: None}``: ``from_pretrained`` needs them passed explicitly."""
    index = read_model_index(Path(path).expanduser())
    return {n: None for n, v in index.items() if not n.startswith("_") and isinstance(v, list) and v[0] is None}


def freeze_non_trainable(pipe: DiffusionPipeline) -> None:
    """Text encoders and the VAE are never trained: no grads, eval mode."""
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3", "vae"):
        module = getattr(pipe, name, None)
        if isinstance(module, torch.nn.Module):
            module.requires_grad_(False)
            module.eval()


def text_components(pipeline_cls: type[DiffusionPipeline]) -> list[str]:
    """The text-encoder and tokenizer arguments of a pipeline class (SD3: 3 + 3, FLUX: 2 + 2, Qwen-Image: 1 + 1)."""
    params = inspect.signature(pipeline_cls.__init__).parameters
    return [name for name in params if name.startswith(("text_encoder", "tokenizer"))]


def load_pipeline(
    path: str | Path,
    architecture: str | None = None,
    torch_dtype: torch.dtype = torch.float32,
    text_encoders: bool = True,
    revision: str | None = None,
) -> DiffusionPipeline:
    """Load the pipeline saved in ``path`` and freeze its text encoders and VAE.

    ``path`` is a local folder, or a Hub id read from the Hugging Face cache at ``revision`` (``hub.resolve_model_path``:
    downloaded there first unless ``HF_HUB_OFFLINE=1``); diffusers itself only ever reads the local folder.

    ``architecture`` (a short name of ``ARCHITECTURES``, a pipeline class name, or None / ``"auto"`` to read
    ``model_index.json``) must agree with the saved ``_class_name`` when both are given.
    ``text_encoders=False`` leaves the text encoders and tokenizers out (None): for a policy whose
    prompts come from precomputed embeddings (``omni_core.models.prompt_embeddings``).
    """
    path = resolve_model_path(path, revision)
    name = check_pipeline_folder(path, architecture)
    cls = BY_PIPELINE[name].pipeline_cls()
    skipped = absent_components(path) | ({} if text_encoders else dict.fromkeys(text_components(cls)))
    try:
        pipe = cls.from_pretrained(path, dtype=torch_dtype, local_files_only=True, **skipped)
    except Exception as err:  # corrupt safetensors, bad configs, ...: one error type naming the path
        raise ModelLoadError(f"{path}: failed to load {name}: {type(err).__name__}: {err}") from err
    freeze_non_trainable(pipe)
    return pipe
