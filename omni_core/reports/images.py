"""Image grids: a batch of generated images `[B, 3, H, W]` uint8 as one PNG, rows = prompts.

The grid is written to disk (next to the checkpoint it belongs to) and embedded in Prefect markdown
artifacts as a `data:` URI, so the UI shows it without a file server.
"""

from __future__ import annotations

import base64
import math
from pathlib import Path

import torch
from PIL import Image


def image_grid(images: torch.Tensor, ncols: int | None = None, pad: int = 2) -> Image.Image:
    """Tile `images` ([B, 3, H, W] uint8) row by row, `ncols` per row (default: about square)."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"image_grid expects [B, 3, H, W] images, got shape {tuple(images.shape)}")
    b, _, h, w = images.shape
    if b == 0:
        raise ValueError("image_grid: no images")
    ncols = ncols or math.ceil(math.sqrt(b))
    nrows = math.ceil(b / ncols)
    grid = Image.new("RGB", (ncols * w + (ncols + 1) * pad, nrows * h + (nrows + 1) * pad), (255, 255, 255))
    pixels = images.to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    for i in range(b):
        r, c = divmod(i, ncols)
        grid.paste(Image.fromarray(pixels[i]), (pad + c * (w + pad), pad + r * (h + pad)))
    return grid


def save_image_grid(images: torch.Tensor, path: str | Path, ncols: int | None = None) -> Path:
    """Write the grid of `images` as a PNG (parent folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image_grid(images, ncols).save(path, format="PNG")
    return path


def png_data_uri(path: str | Path) -> str:
    """`data:image/png;base64,...` of a PNG file, for markdown artifacts."""
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")
