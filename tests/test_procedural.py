"""Procedural scenes and their verifier: 100% on clean renders of every combination, 0% on noise."""

from __future__ import annotations

import numpy as np
import pytest

from omni_core.procedural.scenes import Scene, all_scenes, held_out_split, parse_prompt, render
from omni_core.procedural.verifier import read_scene, verify


def test_the_grid_prompts_and_held_out_split():
    scenes = all_scenes()
    assert len(scenes) == 4 * 3 * 5 * 2 == len({s.prompt for s in scenes})
    scene = Scene("red", "circle", "left", "white")
    assert scene.prompt == "a red circle on the left on a white background"
    assert parse_prompt("A red circle on the left on a white background ") == scene
    with pytest.raises(ValueError, match="not a procedural scene prompt"):
        parse_prompt("a purple dog")
    with pytest.raises(ValueError, match="colour='purple'"):
        Scene("purple", "circle", "left", "white")
    seen, held = held_out_split(24, seed=0)
    assert len(held) == 24 and len(seen) == 96 and not set(seen) & set(held)
    assert held_out_split(24, seed=0) == (seen, held)  # deterministic


def test_the_verifier_reads_every_clean_render_right():
    rng = np.random.default_rng(1)
    for scene in all_scenes():
        for _ in range(3):  # jittered renders of each combination
            image = render(scene, 32, rng)
            assert image.shape == (32, 32, 3) and image.dtype == np.uint8
            result = verify(image, scene)
            assert result["all"], (scene.prompt, read_scene(image, scene.background))


def test_the_verifier_fails_noise_blank_and_wrong_attributes():
    rng = np.random.default_rng(2)
    scenes = all_scenes()
    for i in range(60):
        noise = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        assert not any(verify(noise, scenes[i]).values())  # no object: every attribute fails
    blank = np.full((32, 32, 3), 255, dtype=np.uint8)
    assert verify(blank, Scene("red", "circle", "left", "white")) == {
        "colour": False,
        "shape": False,
        "position": False,
        "all": False,
    }
    # A right picture for another prompt: exactly the attributes that differ fail.
    image = render(Scene("blue", "square", "top", "black"), 32, rng)
    assert verify(image, Scene("red", "square", "top", "black")) == {
        "colour": False,
        "shape": True,
        "position": True,
        "all": False,
    }
    assert verify(image, Scene("blue", "square", "left", "black"))["position"] is False
