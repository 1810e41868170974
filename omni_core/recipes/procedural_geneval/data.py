"""The supervised training set of the procedural benchmark and the biases designed into it, and the prompt files of RL.

A `DataDesign` says which combinations are held out of all training, how many jittered renders each seen
combination gets, and how the captions lie:
- `CaptionBias`: a fixed share of the images *captioned* `attribute=value` (optionally only for scenes matching
  `when`, e.g. `shape=square`) are *drawn* with `drawn_as` instead: a systematic error, so that the most common
  picture for such a prompt is wrong and more supervised training learns the error;
- `LabelNoise`: a share of the captions get a uniformly random value of `attribute` (possibly the right one): noise
  that averages out, since the correct label stays the most common one.
Which image lies is fixed by the seed. `build_training_set` renders everything (9,600 images in about a second).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from omni_core.recipes.procedural_geneval.scenes import (
    BACKGROUNDS,
    COLOURS,
    POSITIONS,
    SHAPES,
    Scene,
    all_scenes,
    held_out_split,
    render,
)
from omni_core.recipes.procedural_geneval.verifier import REWARD_NAME

__all__ = [
    "DATA_SOURCE",
    "CaptionBias",
    "DataDesign",
    "LabelNoise",
    "TrainingSet",
    "build_training_set",
    "write_prompt_file",
]

Attribute = Literal["colour", "shape", "position"]
VALUES: dict[str, Sequence[str]] = {"colour": tuple(COLOURS), "shape": SHAPES, "position": tuple(POSITIONS)}
# The reward that scores a row of the prompt files: the verifier, registered under this name (`verifier`).
DATA_SOURCE = REWARD_NAME


@dataclass(frozen=True)
class CaptionBias:
    """`fraction` of the images captioned `attribute=value` (and matching every `when` pair) show `drawn_as` instead."""

    attribute: Attribute
    value: str
    drawn_as: str
    fraction: float = 0.7
    when: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for v in (self.value, self.drawn_as):
            if v not in VALUES[self.attribute]:
                raise ValueError(f"CaptionBias: {self.attribute}={v!r} is not one of {list(VALUES[self.attribute])}")
        if self.value == self.drawn_as:
            raise ValueError(f"CaptionBias: drawn_as={self.drawn_as!r} must differ from value={self.value!r}")
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"CaptionBias: fraction={self.fraction} must be in (0, 1]")
        for attribute, value in self.when:
            if value not in {**VALUES, "background": tuple(BACKGROUNDS)}.get(attribute, ()):
                raise ValueError(f"CaptionBias: when {attribute}={value!r} is not a scene attribute value")

    def applies_to(self, scene: Scene) -> bool:
        """Whether prompts of `scene` are the ones this bias corrupts."""
        return getattr(scene, self.attribute) == self.value and all(getattr(scene, a) == v for a, v in self.when)

    @property
    def label(self) -> str:
        where = "".join(f" {v}" for _, v in self.when)
        return f"{self.value}{where} drawn {self.drawn_as}"


@dataclass(frozen=True)
class LabelNoise:
    """`fraction` of the captions get a uniformly random value of `attribute` (which may be the drawn one)."""

    attribute: Attribute
    fraction: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"LabelNoise: fraction={self.fraction} must be in [0, 1]")


def default_biases() -> tuple[CaptionBias, ...]:
    """Two independent systematic errors: 70% of "on the left" images drawn in the center, 70% of "blue square"
    images drawn red."""
    return (
        CaptionBias("position", "left", "center", 0.7),
        CaptionBias("colour", "blue", "red", 0.7, when=(("shape", "square"),)),
    )


@dataclass(frozen=True)
class DataDesign:
    """What the supervised data holds and how its captions lie (see the module docstring)."""

    renders_per_combination: int = 100
    n_held_out: int = 24
    split_seed: int = 0
    biases: tuple[CaptionBias, ...] = field(default_factory=default_biases)
    label_noise: tuple[LabelNoise, ...] = ()
    image_size: int = 32

    def split(self) -> tuple[list[Scene], list[Scene]]:
        return held_out_split(self.n_held_out, self.split_seed)

    def fingerprint(self) -> str:
        """A short hash of the design: a cached training set or base model is reused only for the same design."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class TrainingSet:
    """Images (uint8 `[N, S, S, 3]`), the scene each is captioned with, and the scene it shows."""

    images: np.ndarray
    captions: list[Scene]
    drawn: list[Scene]

    def __len__(self) -> int:
        return len(self.captions)

    def lying_share(self) -> float:
        return float(np.mean([c != d for c, d in zip(self.captions, self.drawn, strict=True)]))


def build_training_set(design: DataDesign, seed: int) -> TrainingSet:
    """Render `renders_per_combination` images of every seen combination, captions and lies drawn with `seed`."""
    rng = np.random.default_rng(seed)
    seen, _ = design.split()
    captions, drawn, images = [], [], []
    for scene in seen:
        for _ in range(design.renders_per_combination):
            shown = scene
            for bias in design.biases:
                if bias.applies_to(scene) and rng.random() < bias.fraction:
                    shown = dataclasses.replace(shown, **{bias.attribute: bias.drawn_as})
            caption = scene
            for noise in design.label_noise:
                if rng.random() < noise.fraction:
                    caption = dataclasses.replace(caption, **{noise.attribute: str(rng.choice(VALUES[noise.attribute]))})
            captions.append(caption)
            drawn.append(shown)
            images.append(render(shown, design.image_size, rng))
    return TrainingSet(images=np.stack(images), captions=captions, drawn=drawn)


def scene_ground_truth(scene: Scene, attributes: Sequence[str]) -> dict:
    """The `ground_truth` of a prompt-file row: the scene's attributes and which of them the reward scores."""
    return {**dataclasses.asdict(scene), "attributes": list(attributes)}


def write_prompt_file(path: str | Path, scenes: Sequence[Scene], attributes: Sequence[str]) -> Path:
    """A JSONL prompt file (one row per scene: prompt, `data_source`, `reward_model.ground_truth`) for a run with the
    built-in `procedural_geneval` reward; `attributes` are those its score counts."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = [
        {
            "prompt": scene.prompt,
            "data_source": DATA_SOURCE,
            "reward_model": {"style": "rule", "ground_truth": scene_ground_truth(scene, attributes)},
            "extra_info": {"index": i},
        }
        for i, scene in enumerate(scenes)
    ]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def scene_index(scene: Scene) -> int:
    """The scene's place in `all_scenes()` (its prompt index for seeds)."""
    return all_scenes().index(scene)
