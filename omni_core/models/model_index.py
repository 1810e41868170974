"""A saved diffusers pipeline's `model_index.json`, read without importing diffusers (~3 s on 2 cores): what
cache keys and checks that only list a folder's components need (`prompt_embeddings.text_encoder_fingerprint`),
and what config validation needs to know of the architecture before anything loads: the pipeline class, whether its
transformer is guidance-distilled (`guidance_embeds`, which decides what `guidance_scale` means) and which image sizes
it can sample (`image_size_limits`)."""

from __future__ import annotations

import json
from pathlib import Path

from omni_core.models.architectures import Architecture, find_architecture


class ModelLoadError(ValueError):
    """A model directory could not be loaded; the message names the path and the problem."""


def read_model_index(path: Path) -> dict:
    index_file = path / "model_index.json"
    if not index_file.is_file():
        raise ModelLoadError(f"{path}: no model_index.json; expected a diffusers pipeline directory written by save_pretrained")
    try:
        return json.loads(index_file.read_text())
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{index_file}: not valid JSON ({err})") from err


def pipeline_class_name(path: Path, architecture: str | None = None) -> str | None:
    """The pipeline class a run uses: ``architecture`` (a short name or a class name of ``ARCHITECTURES``) when set
    (not ``"auto"``), else ``model_index.json``'s ``_class_name``; unchecked (``loader.check_pipeline_folder`` checks
    it: an unknown name comes back as written)."""
    if architecture and architecture.lower() != "auto":
        entry = find_architecture(architecture)
        return entry.pipeline if entry else architecture
    return read_model_index(path).get("_class_name")


def transformer_guidance_embeds(path: Path) -> bool:
    """Whether the saved transformer takes a guidance embedding (``transformer/config.json`` ``guidance_embeds``;
    FLUX.1-dev: true, FLUX.1-schnell: false); False when the config is missing or unreadable."""
    config_file = path / "transformer" / "config.json"
    try:
        return bool(json.loads(config_file.read_text()).get("guidance_embeds", False))
    except (OSError, json.JSONDecodeError):
        return False


def config_differences(mine: dict, theirs: dict) -> list[str]:
    """The keys (diffusers' private `_...` ones left out) whose values differ between two component configs, sorted:
    e.g. a distillation teacher's scheduler against the student's."""
    return sorted(k for k in set(mine) | set(theirs) if not k.startswith("_") and mine.get(k) != theirs.get(k))


def _component_config(path: Path, component: str) -> dict | None:
    try:
        return json.loads((path / component / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def vae_scale_factor(vae_config: dict) -> int | None:
    """Pixels per latent cell, as the diffusers pipelines compute it: 2 ** len(temperal_downsample) for Qwen-Image's
    video VAE, 2 ** (len(block_out_channels) - 1) for an AutoencoderKL; None when the config says neither."""
    if "temperal_downsample" in vae_config:
        return 2 ** len(vae_config["temperal_downsample"])
    if vae_config.get("block_out_channels"):
        return 2 ** (len(vae_config["block_out_channels"]) - 1)
    return None


def image_size_limits(path: Path, entry: Architecture) -> tuple[int, int | None, str] | None:
    """The image sides the saved pipeline at `path` can sample, by its architecture's `size_rule`: (the multiple every
    side must be, the largest side or None, how both follow from the configs); None when its configs are unreadable."""
    vae, transformer = _component_config(path, "vae"), _component_config(path, "transformer")
    factor = vae_scale_factor(vae) if vae is not None else None
    if factor is None or transformer is None:
        return None
    if entry.size_rule == "packed_2x2":
        return factor * 2, None, f"VAE scale factor {factor} x the 2 x 2 latent packing"
    patch = int(transformer.get("patch_size", 1))
    table = transformer.get("pos_embed_max_size")
    why = f"VAE scale factor {factor} x patch_size {patch}"
    if table is None:
        return factor * patch, None, why
    return factor * patch, int(table) * patch * factor, f"{why}; pos_embed_max_size {table} patches"
