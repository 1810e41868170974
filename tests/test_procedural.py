"""Procedural scenes and their verifier: 100% on clean renders of every combination, 0% on noise."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from omni_core.recipes.procedural_geneval.scenes import Scene, all_scenes, held_out_split, parse_prompt, render
from omni_core.recipes.procedural_geneval.verifier import read_scene, verify

REPO = Path(__file__).resolve().parents[1]


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


# ----------------------------------------------------------------------------- biases, reward, pixel-space model
def test_a_caption_bias_redraws_its_share_of_the_matching_images_only():
    from omni_core.recipes.procedural_geneval.data import CaptionBias, DataDesign, LabelNoise, build_training_set

    left = CaptionBias("position", "left", "center", 0.7)
    blue_square = CaptionBias("colour", "blue", "red", 0.5, when=(("shape", "square"),))
    data = build_training_set(DataDesign(renders_per_combination=40, biases=(left, blue_square)), seed=3)
    seen, _ = DataDesign().split()
    assert len(data) == 40 * len(seen) and data.images.shape == (len(data), 32, 32, 3)
    pairs = list(zip(data.captions, data.drawn, strict=True))
    assert all(c == d for c, d in pairs if not left.applies_to(c) and not blue_square.applies_to(c))
    moved = [d.position == "center" for c, d in pairs if c.position == "left"]
    recoloured = [d.colour == "red" for c, d in pairs if c.colour == "blue" and c.shape == "square"]
    assert abs(np.mean(moved) - 0.7) < 0.05 and abs(np.mean(recoloured) - 0.5) < 0.08
    assert all(c.colour == "blue" for c, d in pairs if c.colour == "blue" and c.shape != "square" and d.colour == "blue")
    # Each drawn image shows what `drawn` says (the verifier reads it).
    for i in range(0, len(data), 97):
        assert verify(data.images[i], data.drawn[i])["all"]
    # Uniform label noise changes captions, never pictures.
    noisy = build_training_set(DataDesign(renders_per_combination=10, biases=(), label_noise=(LabelNoise("position", 1.0),)), 0)
    assert all(c.colour == d.colour and c.shape == d.shape for c, d in zip(noisy.captions, noisy.drawn, strict=True))
    assert 0.7 < np.mean([c.position != d.position for c, d in zip(noisy.captions, noisy.drawn, strict=True)]) < 0.9
    with pytest.raises(ValueError, match="drawn_as='left' must differ"):
        CaptionBias("position", "left", "left")


def test_the_builtin_procedural_reward_scores_renders_from_the_ground_truth(tmp_path):
    import json

    from omni_core.data.prompts import load_prompts
    from omni_core.recipes.procedural_geneval.data import write_prompt_file
    from omni_core.rewards.manager import RewardManager

    scene = Scene("green", "circle", "bottom", "black")
    path = write_prompt_file(tmp_path / "p.jsonl", [scene], ["colour", "position"])
    row = json.loads(path.read_text())
    assert row["data_source"] == "procedural_geneval" and row["prompt"] == scene.prompt
    record = load_prompts([path])[0]
    right = render(scene, 32, np.random.default_rng(0))
    wrong_place = render(Scene("green", "circle", "top", "black"), 32, np.random.default_rng(0))
    result = RewardManager(None).score(
        [right, wrong_place, right],
        ["procedural_geneval"] * 3,
        [record.ground_truth, record.ground_truth, {**record.ground_truth, "attributes": None}],
    )
    # colour + position scored: 2/2 and 1/2; with all three attributes the circle's shape counts too.
    assert result.scores.tolist()[:2] == [1.0, 0.5]
    assert result.extras[1]["position"] == 0.0 and result.extras[1]["colour"] == 1.0
    assert result.scores[2] == pytest.approx(1.0)
    missing = RewardManager(None).score([right], ["procedural_geneval"], [None])
    assert missing.failed.tolist() == [True] and "reward_model.ground_truth" in missing.reasons[0]


def test_the_pixel_space_pipeline_loads_as_sd3_and_decodes_exactly(tmp_path):
    import torch

    from omni_core.models.arch import PixelSD3Adapter
    from omni_core.models.loader import load_pipeline
    from omni_core.models.policy import FlowPolicy
    from omni_core.recipes.procedural_geneval.model import build_procedural_pipeline, build_scene_tokenizer

    tokenizer = build_scene_tokenizer()
    for scene in all_scenes()[::7]:
        assert len(tokenizer.tokenize(scene.prompt)) == len(scene.prompt.split())  # one token per word
    path = build_procedural_pipeline(tmp_path / "pix", seed=0)
    index = (path / "model_index.json").read_text()
    assert '"vae": [\n    null' in index and not (path / "vae").exists()
    pipe = load_pipeline(path)
    assert type(pipe).__name__ == "StableDiffusion3Pipeline" and pipe.vae is None
    policy = FlowPolicy(path)
    assert isinstance(policy.arch, PixelSD3Adapter) and policy.latent_shape(32, 32) == (3, 32, 32)
    image = render(Scene("yellow", "triangle", "right", "black"), 32, np.random.default_rng(0))
    latents = torch.from_numpy(image).permute(2, 0, 1)[None].float() / 127.5 - 1
    assert torch.equal(policy.decode(latents, 32, 32)[0].permute(1, 2, 0), torch.from_numpy(image))


def test_the_flow_parameters_make_the_designed_biases():
    from omniflow.flows.procedural_geneval import design_from

    design = design_from(1, 0.7, 0.5, 0.2, 24, 10, ["background=black"])
    left, blue = design.biases
    assert (left.attribute, left.value, left.drawn_as, left.fraction) == ("position", "left", "center", 0.7)
    assert (blue.attribute, blue.drawn_as, blue.fraction, blue.when) == ("colour", "red", 0.5, (("background", "black"),))
    assert design.label_noise[0].fraction == 0.2 and design.split_seed == 1
    assert design_from(0, 0.7, 0.7, 0.0, 24, 100, None).biases[1].when == (("shape", "square"),)
    assert [b.attribute for b in design_from(0, 0.0, 0.7, 0.0, 24, 100, []).biases] == ["colour"]
    with pytest.raises(ValueError, match="colour_bias_when: 'square' is not attribute=value"):
        design_from(0, 0.7, 0.7, 0.0, 24, 100, ["square"])


# ----------------------------------------------------------------------- the measured results of docs/benchmarks.md
def _documented_results_table() -> list[list[str]]:
    """The rows (cells) of the table under "Measured: `python benchmarks/procedural_geneval.py --seeds 3`" in
    docs/benchmarks.md."""
    doc = (REPO / "docs" / "benchmarks.md").read_text().splitlines()
    start = next(i for i, line in enumerate(doc) if line.startswith("### Measured: `python benchmarks/procedural_geneval.py"))
    table = []
    for line in doc[start + 1 :]:
        if line.startswith("|"):
            table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif table:
            break
    header, rule, *rows = table
    assert header[0] == "seed" and set("".join(rule)) <= {"-"}, header
    return rows


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"  # as the benchmark's report writes a share (omni_core.recipes.procedural_geneval.report)


def test_the_documented_results_table_equals_the_stored_benchmark_json():
    import json

    stored = json.loads((REPO / "benchmarks" / "results" / "procedural_geneval.json").read_text())
    expected = []  # the table's rows rebuilt from the JSON with the table's rounding: one row per seed and bias
    for seed in stored["seeds"]:
        for i, bias in enumerate(seed["base_accuracy"]["biases"]):
            first = i == 0
            row = (
                [str(seed["seed"]), f"{seed['pretrain']['steps']} ({seed['pretrain']['stopped']})", bias]
                if first
                else ["", "", bias]
            )
            for model in ("base", "rl", "control"):
                seen, held = seed[f"{model}_accuracy"]["biases"][bias], seed[f"{model}_accuracy_held_out"]["biases"][bias]
                row.append(f"{_pct(seen)} / {_pct(held)}")
            row.append(f"{100 * seed['target']['rl_minus_control'][bias]:+.1f}")
            row += [f"{100 * seed['guard']['rl']:.1f} pts", f"{seed['wall_seconds'] / 60:.1f} min"] if first else ["", ""]
            expected.append(row)
    assert stored["seeds_done"] == len(stored["seeds"]) == 3
    assert _documented_results_table() == expected
