"""Built-in rewards that need no downloaded weights: JPEG (in)compressibility.

Semantics of flow_grpo / ddpo ``rewards.py``: encode the image as JPEG at quality 95 with PIL,
``kB = bytes / 1000``; ``jpeg_compressibility = -kB / 500`` (higher = smaller file, e.g. 4.38 kB ->
-0.00876) and ``jpeg_incompressibility = +kB / 500``. The /500 keeps the reward near unit scale for
512 px images; the sign is explicit here because verl-omni's doc and code disagree on it.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch
from PIL import Image

__all__ = ["jpeg_compressibility", "jpeg_incompressibility", "jpeg_size_kb", "to_hwc_uint8"]

JPEG_QUALITY = 95
KB_SCALE = 500.0


def to_hwc_uint8(image: Any) -> np.ndarray:
    """An image as a ``[H, W, C]`` (or ``[H, W]``) uint8 numpy array.

    Accepts a PIL image, a numpy array in HWC layout, or a torch tensor in CHW layout (verl-omni
    hands rewards uint8 CHW pixels). Float inputs are taken to be in ``[0, 1]``.
    """
    if isinstance(image, Image.Image):
        return np.asarray(image)
    if isinstance(image, torch.Tensor):
        t = image.detach().cpu()
        if t.dim() == 3:
            t = t.permute(1, 2, 0)  # CHW -> HWC
        array = t.numpy()
    else:
        array = np.asarray(image)
        if array.ndim == 3 and array.shape[0] in (1, 3, 4) and array.shape[-1] not in (1, 3, 4):
            array = array.transpose(1, 2, 0)  # a CHW array (e.g. a tensor's .numpy())
    if array.ndim not in (2, 3):
        raise ValueError(f"expected an image with 2 or 3 dims, got shape {tuple(array.shape)}")
    if array.dtype != np.uint8:
        if not np.issubdtype(array.dtype, np.floating):
            raise TypeError(f"expected uint8 or float pixels in [0, 1], got dtype {array.dtype}")
        array = (np.clip(array, 0.0, 1.0) * 255.0).round().astype(np.uint8)
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    return np.ascontiguousarray(array)


def jpeg_size_kb(image: Any, quality: int = JPEG_QUALITY) -> float:
    """Size in kB (1000 bytes) of ``image`` encoded as JPEG at ``quality``."""
    buffer = io.BytesIO()
    Image.fromarray(to_hwc_uint8(image)).save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1000.0


def jpeg_compressibility(image: Any) -> float:
    """``-kB / 500`` of the q=95 JPEG: rewards images that compress well (flow_grpo's sign)."""
    return -jpeg_size_kb(image) / KB_SCALE


def jpeg_incompressibility(image: Any) -> float:
    """``+kB / 500`` of the q=95 JPEG: rewards images that compress badly."""
    return jpeg_size_kb(image) / KB_SCALE
