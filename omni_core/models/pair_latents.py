"""The VAE latents of offline preference pairs' images, encoded once per image set and read by the controller.

Offline Diffusion-DPO trains on data-set images instead of rollouts: each image is loaded (RGB), resized to the run's
`rollout.pipeline.height` x `width` and scaled to [-1, 1] by diffusers' `VaeImageProcessor` (the pipelines' own
preprocessing), then encoded alone through the pipeline's VAE by the architecture adapter's `encode_images` (the
posterior mean, the inverse of its `decode`), so an image's latents do not depend on which images shared its batch and
equal a fresh encoding bit for bit on the same device.

One safetensors file (never pickle) holds one fp32 tensor per image, `<image key>` (``image_key(path)``, of its absolute
path) in the layout `FlowPolicy.latent_shape` gives, and metadata (format, architecture, the VAE files' fingerprint,
height, width, count, device). `encode_pair_images` writes it; `PairLatents` reads rows back, memory-mapped. Its cache
key (`latents_key`) holds the sha256 of every image file, the VAE files, the size, the architecture and the device, so
an edited image makes a new file.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from omni_core.cache_keys import key_of
from omni_core.models.hub import model_folder, resolve_model_path
from omni_core.models.model_index import read_model_index
from omni_core.models.prompt_embeddings import save_file_atomically

FORMAT = "omniflow-pair-latents/1"
# The pipeline components that encoding reads: the VAE (and the scheduler the pipeline class expects).
KEPT_COMPONENTS = ("vae", "scheduler")


def image_key(path: str | Path) -> str:
    """The tensor name of one image in the file: 32 hex digits of the sha256 of its absolute path."""
    return hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:32]


def unique_images(pairs: Sequence[Any]) -> list[str]:
    """Every image of `pairs` (`PreferencePair`s: chosen and rejected), sorted and unique."""
    return sorted({image for pair in pairs for image in pair.images})


def vae_fingerprint(model_path: str | Path) -> str:
    """sha256 over (relative name, sha256 of bytes) of the VAE folder's files ("" for a pixel-space model)."""
    from omni_core.cache_keys import fingerprint_files

    vae = Path(model_path).expanduser() / "vae"
    return fingerprint_files([vae]) if vae.is_dir() else ""


def latents_key(actor_rollout_ref: Any, device: str, images: list[str]) -> str:
    """The cache key of a run's pair latents (`actor_rollout_ref`: that config section)."""
    model, pipeline = actor_rollout_ref.model, actor_rollout_ref.rollout.pipeline
    fields = {
        "vae": vae_fingerprint(model_folder(model)),
        "architecture": model.architecture,
        "height": pipeline.height,
        "width": pipeline.width,
        "device": device,
        "images": images,
    }
    return key_of("pair-latents", [Path(p) for p in images], fields)


def load_image_pixels(path: str | Path, height: int, width: int) -> torch.Tensor:
    """The image at `path` as the VAE sees it: RGB, resized to `height` x `width`, in [-1, 1], a batch of one
    ``[1, 3, H, W]`` fp32 exactly as the pipelines' `image_processor.preprocess` returns it (its memory layout too: a
    convolution's last bits depend on it)."""
    from diffusers.image_processor import VaeImageProcessor
    from PIL import Image

    with Image.open(path) as image:
        rgb = image.convert("RGB")
    return VaeImageProcessor().preprocess(rgb, height=height, width=width)


def pixels_to_uint8(pixels: torch.Tensor) -> torch.Tensor:
    """[-1, 1] pixels -> uint8 (the inverse of the processor's scaling)."""
    return ((pixels.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)


def _vae_adapter(model_path: Path, architecture: str | None, device: str, torch_dtype: torch.dtype):
    # diffusers only here: a run that finds the latents cached never loads the VAE.
    from omni_core.models.architectures import BY_PIPELINE
    from omni_core.models.loader import ModelLoadError, check_pipeline_folder

    name = check_pipeline_folder(model_path, architecture)
    entry = BY_PIPELINE[name]
    others = {c: None for c, v in read_model_index(model_path).items() if isinstance(v, list) and c not in KEPT_COMPONENTS}
    try:
        pipe = entry.pipeline_cls().from_pretrained(model_path, **others, dtype=torch_dtype, local_files_only=True)
    except Exception as err:  # corrupt safetensors, bad configs, ...: one error type naming the path
        raise ModelLoadError(f"{model_path}: failed to load the VAE of {name}: {type(err).__name__}: {err}") from err
    pipe = pipe.to(device)
    pipe.vae.requires_grad_(False).eval()
    return entry.adapter_cls()(pipe)


@torch.no_grad()
def encode_pair_images(
    model_path: str | Path,
    images: Sequence[str],
    height: int,
    width: int,
    out_file: str | Path,
    device: str | torch.device = "cpu",
    architecture: str | None = None,
    *,
    torch_dtype: torch.dtype = torch.float32,
    revision: str | None = None,
) -> Path:
    """Encode every image of `images` alone through the pipeline's VAE (module docstring); write `out_file` atomically
    and return its path. A pixel-space model (no VAE folder) stores the [-1, 1] pixels themselves."""
    model_path = resolve_model_path(model_path, revision)
    out_file = Path(out_file)
    has_vae = (Path(model_path) / "vae").is_dir()
    adapter = _vae_adapter(Path(model_path), architecture, str(device), torch_dtype) if has_vae else None
    tensors: dict[str, torch.Tensor] = {}
    for image in sorted(set(images)):
        pixels = load_image_pixels(image, height, width)
        latents = pixels if adapter is None else adapter.encode_images(pixels.to(device), height, width)
        tensors[image_key(image)] = latents[0].float().contiguous().cpu()
    metadata = {
        "format": FORMAT,
        "architecture": architecture or "",
        "vae_fingerprint": vae_fingerprint(model_path),
        "height": str(height),
        "width": str(width),
        "count": str(len(tensors)),
        "device": torch.device(device).type,
        "images": json.dumps(sorted(set(images))),
    }
    return save_file_atomically(tensors, out_file, metadata)


class PairLatents:
    """The pair latents of a run, read lazily from the file `encode_pair_images` wrote. Picklable (the path travels)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = None

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])

    def _open(self):
        if self._file is None:
            if not self.path.is_file():
                raise FileNotFoundError(f"pair-latents file {self.path} does not exist; run prepare_pair_latents again")
            self._file = safe_open(str(self.path), framework="pt", device="cpu")
        return self._file

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) the images were resized to."""
        meta = self._open().metadata() or {}
        return int(meta["height"]), int(meta["width"])

    def latents(self, images: Sequence[str]) -> torch.Tensor:
        """``[len(images), *latent]`` fp32, in the order of `images` (paths as the records hold them)."""
        f = self._open()
        keys = set(f.keys())
        rows = []
        for image in images:
            key = image_key(image)
            if key not in keys:
                raise KeyError(f"{image} is not in the pair-latents file {self.path}; run prepare_pair_latents again")
            rows.append(f.get_tensor(key))
        return torch.stack(rows)
