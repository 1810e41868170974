"""The rule-based verifier of procedural scenes: what an image shows, attribute by attribute, against its prompt.

Reading an image (uint8 `[H, W, 3]`) for the scene its prompt names:
1. foreground = pixels whose RGB distance to the prompt's background colour is above `FOREGROUND_DISTANCE`;
2. keep the largest 4-connected component (stray speckles would wreck shape and position);
3. colour = the palette colour nearest to the component's mean colour;
   position = the anchor nearest to its centroid;
   shape = from the fill ratio of its bounding box (square > 0.9 >= circle > 0.66 >= triangle: a disc fills
   pi / 4 = 0.79 of its box, a triangle 0.5).
A component under `MIN_PIXELS` or over half the image is no object: every attribute fails.

Importing this module registers `verifier_reward` as the reward `procedural_geneval` (`REWARD_NAME`, the
`data_source` of the recipe's prompt files); pyproject.toml declares it under the `omni_core.rewards` entry points,
so a process that meets the name (a Ray rollout worker) imports it there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_core.recipes.procedural_geneval.scenes import BACKGROUNDS, COLOURS, POSITIONS, Scene
from omni_core.rewards.plugins import register_reward

__all__ = ["ATTRIBUTES", "REWARD_NAME", "Reading", "read_scene", "verifier_reward", "verify"]

REWARD_NAME = "procedural_geneval"

ATTRIBUTES = ("colour", "shape", "position")

FOREGROUND_DISTANCE = 100.0
MIN_PIXELS = 8
SQUARE_FILL, CIRCLE_FILL = 0.9, 0.66


@dataclass(frozen=True)
class Reading:
    """What the verifier saw: the attributes (None when there is no object) and the component's size in pixels."""

    colour: str | None
    shape: str | None
    position: str | None
    pixels: int


def _largest_component(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected component of a boolean mask (an empty mask gives an empty one)."""
    seen = np.zeros_like(mask)
    best: list[tuple[int, int]] = []
    h, w = mask.shape
    for y, x in zip(*np.nonzero(mask), strict=True):
        if seen[y, x]:
            continue
        seen[y, x] = True
        queue, part = deque([(int(y), int(x))]), []
        while queue:
            cy, cx = queue.popleft()
            part.append((cy, cx))
            for ny, nx in ((cy - 1, cx), (cy + 1, cx), (cy, cx - 1), (cy, cx + 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    queue.append((ny, nx))
        if len(part) > len(best):
            best = part
    out = np.zeros_like(mask)
    if best:
        ys, xs = zip(*best, strict=True)
        out[list(ys), list(xs)] = True
    return out


def _nearest(value: np.ndarray, table: dict[str, tuple[float, ...]]) -> str:
    return min(table, key=lambda k: float(np.sum((np.asarray(table[k], dtype=np.float64) - value) ** 2)))


def read_scene(image: np.ndarray, background: str) -> Reading:
    """The object of `image` (uint8 `[H, W, 3]`) on the named background."""
    pixels = np.asarray(image, dtype=np.float64)
    if pixels.ndim != 3 or pixels.shape[-1] != 3:
        raise ValueError(f"expected an RGB image [H, W, 3], got shape {pixels.shape}")
    h, w, _ = pixels.shape
    distance = np.linalg.norm(pixels - np.asarray(BACKGROUNDS[background], dtype=np.float64), axis=-1)
    component = _largest_component(distance > FOREGROUND_DISTANCE)
    count = int(component.sum())
    if count < MIN_PIXELS or count > h * w / 2:
        return Reading(None, None, None, count)
    ys, xs = np.nonzero(component)
    colour = _nearest(pixels[component].mean(axis=0), COLOURS)
    centroid = np.array([xs.mean() / w, ys.mean() / h])
    position = _nearest(centroid, POSITIONS)
    fill = count / float((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
    shape = "square" if fill > SQUARE_FILL else "circle" if fill > CIRCLE_FILL else "triangle"
    return Reading(colour, shape, position, count)


def verify(image: np.ndarray, scene: Scene) -> dict[str, bool]:
    """Per-attribute correctness of `image` for `scene`: colour, shape, position and all three."""
    seen = read_scene(image, scene.background)
    result = {
        "colour": seen.colour == scene.colour,
        "shape": seen.shape == scene.shape,
        "position": seen.position == scene.position,
    }
    result["all"] = all(result.values())
    return result


def verifier_reward(image: Any, ground_truth: Mapping[str, Any] | None) -> dict[str, float]:
    """The `procedural_geneval` reward of one image (uint8 CHW tensor, HWC array or PIL image).

    `ground_truth`: the scene (`colour`, `shape`, `position`, `background`) and optionally `attributes`, the attributes
    the score counts (default all three). Returns `{"score": fraction of those correct, <attribute>: 0 or 1, "all": 0
    or 1}`; a row without a scene raises ValueError naming what is missing.
    """
    from omni_core.rewards.builtin import to_hwc_uint8

    if not isinstance(ground_truth, Mapping):
        raise ValueError(
            "procedural_geneval needs the scene as the row's reward_model.ground_truth "
            "({colour, shape, position, background}); write the prompt file with "
            "omni_core.recipes.procedural_geneval.data.write_prompt_file"
        )
    missing = [k for k in ("colour", "shape", "position", "background") if k not in ground_truth]
    if missing:
        raise ValueError(f"procedural_geneval: ground_truth lacks {missing}")
    scene = Scene(*(ground_truth[k] for k in ("colour", "shape", "position", "background")))
    attributes = list(ground_truth.get("attributes") or ATTRIBUTES)
    unknown = sorted(set(attributes) - set(ATTRIBUTES))
    if unknown:
        raise ValueError(f"procedural_geneval: ground_truth attributes {unknown} are not among {list(ATTRIBUTES)}")
    correct = verify(to_hwc_uint8(image), scene)
    values = {k: float(v) for k, v in correct.items()}
    return {"score": sum(values[a] for a in attributes) / len(attributes), **values}


register_reward(REWARD_NAME, verifier_reward, owner=__name__)
