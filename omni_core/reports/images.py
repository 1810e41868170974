"""Image grids: a batch of generated images `[B, 3, H, W]` uint8 as one PNG, rows = prompts.

The grid is written to disk (next to the checkpoint it belongs to) and shown in Prefect markdown artifacts by
`markdown_image`: embedded as a `data:` URI (the UI shows it without a file server) up to
`MAX_EMBEDDED_PNG_BYTES`, linked as a `file://` URL above that.
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


# The largest PNG embedded in an artifact. An artifact's markdown is a row of the Prefect database, read whole by
# the UI's artifact pages, and base64 adds a third: every epoch's grid and the redrawn reward curve add to it. The
# tiny model's grids and the reward curves are 2-60 kB; a validation grid of a real model (8 prompts x 4 samples of
# 512 px) is several MB, which would make the database and each artifact page that much heavier per validation.
MAX_EMBEDDED_PNG_BYTES = 256 * 1024


def markdown_image(path: str | Path, alt: str, max_bytes: int = MAX_EMBEDDED_PNG_BYTES) -> str:
    """`![alt](data:...)` for a PNG of at most `max_bytes`; a link to the file (`file://` URL, and its path)
    for a larger one, which stays out of the Prefect database."""
    path = Path(path).resolve()
    size = path.stat().st_size
    if size <= max_bytes:
        return f"![{alt}]({png_data_uri(path)})"
    return (
        f"[{alt}]({path.as_uri()}) (PNG of {size / 1024:.0f} kB, linked: images over {max_bytes / 1024:.0f} kB "
        f"are not embedded in the Prefect database; on the machine that ran it: `{path}`)"
    )


def png_data_uri(path: str | Path) -> str:
    """`data:image/png;base64,...` of a PNG file, for markdown artifacts."""
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")
