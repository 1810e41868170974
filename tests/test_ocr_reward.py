"""The built-in `ocr` reward: flow_grpo's score written out here, and the real PP-OCRv4 model (ONNX files inside the
rapidocr-onnxruntime wheel) reading text rendered with PIL."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from omni_core.config import ConfigError, load_config
from omni_core.rewards.manager import RewardManager
from omni_core.rewards.ocr import edit_distance, ocr_score, ocr_target
from omni_core.validation import config_problems


def _render(text: str, size: tuple[int, int] = (256, 96)) -> torch.Tensor:
    """Black text on white, uint8 CHW (what the rollout hands a reward)."""
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((10, 30), text, fill="black", font=ImageFont.load_default(size=32))
    return torch.from_numpy(np.array(image)).permute(2, 0, 1)


@pytest.mark.parametrize(("a", "b", "d"), [("kitten", "sitting", 3), ("", "abc", 3), ("abc", "abc", 0), ("flaw", "lawn", 2)])
def test_edit_distance_is_levenshtein(a, b, d):
    assert edit_distance(a, b) == d == edit_distance(b, a)


def test_the_target_comes_from_the_ground_truth_or_the_prompts_quoted_text():
    assert ocr_target('A sign that says "Hello World" at dawn') == "Hello World"  # flow_grpo's prompts
    assert ocr_target("anything", "Open 24h") == "Open 24h"  # verl-omni's OCR rows: the bare solution
    assert ocr_target(None, 'a neon sign "BAR" at night') == "BAR"  # verl-omni's HTTP-service rows: the whole prompt
    assert ocr_target("no quotes here") is None and ocr_target('empty ""') is None


def test_the_score_is_flow_grpos():
    """1 - d / len(target), d the Levenshtein distance of the lower-cased, space-free texts, 0 when the target is
    inside what was read, capped at len(target)."""
    assert ocr_score("Hello World", "hello world") == 1.0
    assert ocr_score("xx HELLOWORLD yy", "Hello World") == 1.0  # contained
    assert ocr_score("Hellp World", "Hello World") == pytest.approx(1 - 1 / 10)
    assert ocr_score("", "Hello") == 0.0
    assert ocr_score("a completely different and long text", "Hi") == 0.0  # capped at len(target)


def test_the_real_ocr_model_reads_rendered_text():
    """Through the reward manager, as a `reward.reward_functions` entry: exact text 1.0, one wrong letter of 8
    1 - 1/8, a blank image 0.0, and a prompt without quoted text (and no ground truth) a failed sample saying why."""
    manager = RewardManager({"reward_functions": [{"name": "ocr"}]})
    images = torch.stack([_render("Hello OCR"), _render("Hellp OCR"), _render(""), _render("Hello OCR")])
    prompts = ['a sign "Hello OCR"'] * 3 + ["a sign"]
    result = manager.score(images, "any", prompts=prompts)
    assert result.scores[:3].tolist() == pytest.approx([1.0, 1 - 1 / 8, 0.0])
    assert result.failed.tolist() == [False, False, False, True] and "no target text" in result.reasons[3]


def test_verl_omnis_ocr_rows_select_the_ocr_reward_by_their_data_source():
    """verl-omni's OCR data (`data_source="flow_grpo/ocr"`, the bare solution as `reward_model.ground_truth`) is scored
    by the built-in OCR reward with no reward config."""
    manager = RewardManager({"reward_functions": []})
    result = manager.score(_render("Open Late")[None], ["flow_grpo/ocr"], ground_truths=["open late"], prompts=["a shop"])
    assert result.scores.tolist() == [1.0]


def test_an_ocr_entry_validates_and_refuses_keys_it_does_not_take(tiny_sd3_dir):
    model = f"actor_rollout_ref.model.path={tiny_sd3_dir}"
    assert not [p for p in config_problems(load_config(overrides=[model, "reward.reward_functions=[{name: ocr}]"])) if p.key.startswith("reward")]
    try:
        problems = config_problems(load_config(overrides=[model, "reward.reward_functions=[{name: ocr, model_path: /x}]"]))
    except ConfigError as err:
        problems = err.problems
    assert [p.key for p in problems if p.key.startswith("reward")] == ["reward.reward_functions[0].model_path"]
