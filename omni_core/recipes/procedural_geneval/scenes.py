"""Procedural scenes: the attribute grid, the prompt template, held-out combinations and PIL renders.

A scene is one coloured shape at one of five positions on a plain background, e.g. "a red circle on the left on a
white background": 4 colours x 3 shapes x 5 positions x 2 backgrounds = 120 combinations. `render` draws a scene at
`size` x `size` pixels with a little jitter of the shape's size and place (from the given generator), so a
combination has many distinct training images. Everything is deterministic given its seed.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

__all__ = [
    "BACKGROUNDS",
    "COLOURS",
    "POSITIONS",
    "SHAPES",
    "Scene",
    "all_scenes",
    "held_out_split",
    "parse_prompt",
    "render",
]

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 60, 220),
    "yellow": (230, 200, 20),
}
SHAPES = ("circle", "square", "triangle")
# Anchor of the shape's centre, as a fraction of the image side (x, y).
POSITIONS: dict[str, tuple[float, float]] = {
    "left": (0.25, 0.5),
    "right": (0.75, 0.5),
    "top": (0.5, 0.25),
    "bottom": (0.5, 0.75),
    "center": (0.5, 0.5),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {"white": (255, 255, 255), "black": (0, 0, 0)}
_PLACE = {
    "left": "on the left",
    "right": "on the right",
    "top": "at the top",
    "bottom": "at the bottom",
    "center": "in the center",
}


@dataclass(frozen=True)
class Scene:
    """One combination of attributes; `prompt` is its caption."""

    colour: str
    shape: str
    position: str
    background: str

    def __post_init__(self) -> None:
        for value, allowed, name in (
            (self.colour, COLOURS, "colour"),
            (self.shape, SHAPES, "shape"),
            (self.position, POSITIONS, "position"),
            (self.background, BACKGROUNDS, "background"),
        ):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not one of {list(allowed)}")

    @property
    def prompt(self) -> str:
        return f"a {self.colour} {self.shape} {_PLACE[self.position]} on a {self.background} background"


def all_scenes() -> list[Scene]:
    """The 120 combinations, in a fixed order."""
    return [Scene(*combo) for combo in itertools.product(COLOURS, SHAPES, POSITIONS, BACKGROUNDS)]


def held_out_split(n_held_out: int, seed: int) -> tuple[list[Scene], list[Scene]]:
    """(seen, held_out): `n_held_out` combinations drawn with `seed` are kept out of all training."""
    scenes = all_scenes()
    if not 0 <= n_held_out < len(scenes):
        raise ValueError(f"n_held_out={n_held_out} must be in [0, {len(scenes)})")
    held = set(random.Random(seed).sample(range(len(scenes)), n_held_out))
    return [s for i, s in enumerate(scenes) if i not in held], [s for i, s in enumerate(scenes) if i in held]


def parse_prompt(prompt: str) -> Scene:
    """The scene a prompt of the template describes; anything else raises ValueError naming the prompt."""
    words = prompt.strip().lower().split()
    for scene in all_scenes():
        if scene.prompt.split() == words:
            return scene
    raise ValueError(f"{prompt!r} is not a procedural scene prompt, e.g. {all_scenes()[0].prompt!r}")


def render(scene: Scene, size: int = 32, rng: np.random.Generator | None = None) -> np.ndarray:
    """The scene as a uint8 `[size, size, 3]` image; `rng` jitters the shape's size (+-10%) and place (+-1.5 px)."""
    jitter = rng if rng is not None else np.random.default_rng(0)
    radius = size * 0.16 * float(jitter.uniform(0.9, 1.1))
    cx, cy = (a * size + float(jitter.uniform(-1.5, 1.5)) for a in POSITIONS[scene.position])
    image = Image.new("RGB", (size, size), BACKGROUNDS[scene.background])
    draw, fill = ImageDraw.Draw(image), COLOURS[scene.colour]
    if scene.shape == "circle":
        draw.ellipse([cx - radius, cy - radius, cx + radius, cy + radius], fill=fill)
    elif scene.shape == "square":
        half = radius * 0.9
        draw.rectangle([cx - half, cy - half, cx + half, cy + half], fill=fill)
    else:  # an upright triangle around the centre
        draw.polygon([(cx, cy - radius), (cx - radius, cy + radius * 0.8), (cx + radius, cy + radius * 0.8)], fill=fill)
    return np.asarray(image, dtype=np.uint8).copy()
