"""Rewards: JPEG built-ins against PIL, custom reward files, the manager's selection and failures."""

from __future__ import annotations

import io
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from omni_core.rewards.builtin import jpeg_compressibility, jpeg_incompressibility
from omni_core.rewards.custom import RewardLoadError, load_reward_function
from omni_core.rewards.manager import RewardManager
from omni_core.rewards.registry import default_compute_score

torch.set_num_threads(1)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rewards" / "brightness_reward.py"


def flat_image(value: int = 128) -> np.ndarray:
    return np.full((32, 32, 3), value, dtype=np.uint8)


def noise_image(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)


def pil_jpeg_bytes(hwc: np.ndarray) -> int:
    """Independent reference: the JPEG (q=95) byte count straight from PIL."""
    buf = io.BytesIO()
    Image.fromarray(hwc).save(buf, format="JPEG", quality=95)
    return len(buf.getvalue())


def reward_cfg(path=None, name="compute_score", reward_functions=(), aggregation="weighted_sum"):
    return SimpleNamespace(
        custom_reward_function=SimpleNamespace(path=path, name=name),
        reward_functions=list(reward_functions),
        aggregation=aggregation,
    )


def write(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(source)
    return path


# ----------------------------------------------------------------------------------------- built-ins


def test_jpeg_value_matches_pil_and_ranks_flat_above_noise():
    flat, noise = flat_image(), noise_image()
    assert jpeg_compressibility(noise) == pytest.approx(-pil_jpeg_bytes(noise) / 1000 / 500)
    assert jpeg_compressibility(flat) > jpeg_compressibility(noise)
    assert jpeg_incompressibility(flat) < jpeg_incompressibility(noise)
    assert jpeg_incompressibility(noise) == -jpeg_compressibility(noise)


def test_chw_tensor_and_hwc_array_score_the_same():
    noise = noise_image(1)
    chw = torch.from_numpy(noise).permute(2, 0, 1)
    assert jpeg_compressibility(chw) == jpeg_compressibility(noise)
    assert jpeg_compressibility(chw.numpy()) == jpeg_compressibility(noise)
    # float pixels in [0, 1] are accepted and quantised back to the same uint8 image
    assert jpeg_compressibility(chw.float() / 255) == jpeg_compressibility(noise)


def test_default_compute_score_dispatches_on_data_source():
    noise = noise_image()
    assert default_compute_score("jpeg_incompressibility", noise, None, {}) == jpeg_incompressibility(noise)
    with pytest.raises(ValueError, match=r"unknown reward 'ocr'.*jpeg_compressibility"):
        default_compute_score("ocr", noise, None, {})


def test_manager_without_functions_dispatches_per_sample_and_rejects_unknown_sources():
    images = torch.from_numpy(np.stack([flat_image(), noise_image()])).permute(0, 3, 1, 2)
    result = RewardManager(reward_cfg()).score(images, ["jpeg_compressibility", "jpeg_incompressibility"])
    assert result.scores.tolist() == pytest.approx([jpeg_compressibility(flat_image()), jpeg_incompressibility(noise_image())])
    assert not result.failed.any() and result.reasons == [None, None]
    with pytest.raises(ValueError, match=r"no built-in reward for data_source \['geneval'\]"):
        RewardManager(reward_cfg()).score(images, ["jpeg_compressibility", "geneval"])


# ----------------------------------------------------------------------------------------- custom files


def test_example_brightness_reward_loads_and_keeps_dict_extras():
    images = torch.from_numpy(np.stack([flat_image(255), flat_image(0), flat_image(51)])).permute(0, 3, 1, 2)
    result = RewardManager(reward_cfg(path=str(EXAMPLE))).score(images, "any_source")
    assert result.scores.tolist() == pytest.approx([1.0, 0.0, 0.2])  # 51 / 255 = 0.2
    assert [e["pixel_std"] for e in result.extras] == pytest.approx([0.0, 0.0, 0.0], abs=1e-6)
    assert not result.failed.any()


def test_custom_function_receives_the_verl_contract(tmp_path):
    path = write(
        tmp_path,
        "echo.py",
        (
            "def score_it(data_source, solution_image, ground_truth, extra_info):\n"
            "    return {'score': float(ground_truth) + extra_info['bonus'],\n"
            "            'source': data_source, 'shape': tuple(solution_image.shape)}\n"
        ),
    )
    images = torch.zeros(2, 3, 4, 5, dtype=torch.uint8)
    result = RewardManager(reward_cfg(path=str(path), name="score_it")).score(
        images, ["a", "b"], ground_truths=[1, 2], extra_infos=[{"bonus": 0.5}, {"bonus": 0.25}]
    )
    assert result.scores.tolist() == [1.5, 2.25]
    assert result.extras == [{"source": "a", "shape": (3, 4, 5)}, {"source": "b", "shape": (3, 4, 5)}]


def test_syntax_error_names_the_file_and_line(tmp_path):
    path = write(tmp_path, "broken.py", "def compute_score(:\n    return 1\n")
    with pytest.raises(RewardLoadError, match=r"syntax error in reward file .*broken\.py, line 1"):
        load_reward_function(path)


def test_failing_import_names_the_file_and_the_original_error(tmp_path):
    path = write(tmp_path, "needs_pkg.py", "import not_a_real_package_xyz\n")
    with pytest.raises(RewardLoadError, match=r"needs_pkg\.py failed: ModuleNotFoundError: .*not_a_real_package_xyz"):
        load_reward_function(path)


def test_missing_function_lists_the_callables_found(tmp_path):
    path = write(tmp_path, "other.py", "import math\nLIMIT = 3\ndef reward_a(*a):\n    return 1.0\n")
    with pytest.raises(RewardLoadError, match=r"other\.py has no function 'compute_score'.*\['reward_a'\]"):
        RewardManager(reward_cfg(path=str(path)))
    with pytest.raises(RewardLoadError, match=r"'LIMIT' in reward file .*other\.py is a int, not a function"):
        load_reward_function(path, "LIMIT")
    with pytest.raises(RewardLoadError, match=r"nowhere\.py does not exist"):
        load_reward_function(tmp_path / "nowhere.py")


# ----------------------------------------------------------------------------------------- failures


def test_a_failing_reward_marks_only_its_sample_with_the_reason(tmp_path):
    path = write(
        tmp_path,
        "flaky.py",
        (
            "def compute_score(data_source, solution_image, ground_truth, extra_info):\n"
            "    mode = extra_info.get('mode')\n"
            "    if mode == 'raise':\n"
            "        return 1 / 0\n"
            "    if mode == 'nan':\n"
            "        return float('nan')\n"
            "    if mode == 'text':\n"
            "        return 'good'\n"
            "    return 0.75\n"
        ),
    )
    images = torch.zeros(4, 3, 8, 8, dtype=torch.uint8)
    infos = [{"mode": "raise"}, {}, {"mode": "nan"}, {"mode": "text"}]
    result = RewardManager(reward_cfg(path=str(path))).score(images, "x", extra_infos=infos)
    assert result.failed.tolist() == [True, False, True, True]
    assert result.scores[1].item() == 0.75
    assert all(math.isnan(result.scores[i].item()) for i in (0, 2, 3))  # never a silent 0
    assert result.reasons[0] == "flaky.compute_score: ZeroDivisionError: division by zero"
    assert result.reasons[1] is None
    assert "non-finite score nan" in result.reasons[2]
    assert "TypeError" in result.reasons[3] and "expected a number" in result.reasons[3]


# ----------------------------------------------------------------------------------------- weighted sum


def test_weighted_sum_of_builtin_and_custom_rewards(tmp_path):
    images_hwc = [noise_image(2), flat_image(102)]
    images = torch.from_numpy(np.stack(images_hwc)).permute(0, 3, 1, 2)
    cfg = reward_cfg(
        reward_functions=[
            {"name": "jpeg_compressibility", "weight": 2.0},
            {"path": str(EXAMPLE), "function": "compute_score", "name": "bright", "weight": 0.5},
        ]
    )
    result = RewardManager(cfg).score(images, "ignored")
    for i, hwc in enumerate(images_hwc):
        jpeg = -pil_jpeg_bytes(hwc) / 1000 / 500
        bright = hwc.mean() / 255
        # 2.0 * jpeg + 0.5 * brightness
        assert result.scores[i].item() == pytest.approx(2.0 * jpeg + 0.5 * bright, rel=1e-5)
        assert result.extras[i]["jpeg_compressibility"] == pytest.approx(jpeg)
        assert result.extras[i]["bright"] == pytest.approx(bright)
        assert "bright/pixel_std" in result.extras[i]


def test_verl_mapping_form_and_plain_names_are_accepted():
    cfg = reward_cfg()
    cfg.reward_functions = {
        "bright": {"path": str(EXAMPLE), "name": "compute_score", "weight": 1.0},
        "jpeg_incompressibility": {"weight": 3.0},
    }
    img = flat_image(255)
    result = RewardManager(cfg).score([img], ["x"])
    assert result.scores.item() == pytest.approx(1.0 + 3.0 * jpeg_incompressibility(img), rel=1e-5)
    plain = RewardManager(reward_cfg(reward_functions=["jpeg_incompressibility"])).score([img], ["x"])
    assert plain.scores.item() == pytest.approx(jpeg_incompressibility(img))


def test_config_errors_list_the_choices():
    with pytest.raises(ValueError, match=r"unknown reward 'hpsv3'.*jpeg_incompressibility.*pickscore"):
        RewardManager(reward_cfg(reward_functions=["hpsv3"]))
    with pytest.raises(ValueError, match=r"reward_functions\[0\]\.model_path.*pickscore needs model_path"):
        RewardManager(reward_cfg(reward_functions=["pickscore"]))
    with pytest.raises(ValueError, match=r"aggregation='mean' is not supported"):
        RewardManager(reward_cfg(aggregation="mean"))
    with pytest.raises(ValueError, match=r"reward_functions\[0\] has unknown keys \['wieght'\]"):
        RewardManager(reward_cfg(reward_functions=[{"name": "jpeg_compressibility", "wieght": 2}]))
