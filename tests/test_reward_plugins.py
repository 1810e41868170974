"""Rewards added from outside the core (`omni_core.rewards.plugins`): a package declares a reward under the
`omni_core.rewards` entry points, the core imports its module on first use of the name (as a Ray worker that only
meets the name would), validation accepts the name without importing it, and errors name where rewards come from.

The packages here are real: a `*.dist-info` folder with an `entry_points.txt` and a module, on `sys.path`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from omni_core.config.schema import RewardFunctionSpec
from omni_core.rewards import plugins
from omni_core.rewards.manager import RewardManager
from omni_core.rewards.registry import get_reward_function
from omni_core.validation.reward_terms import entry_problems

REGISTERS = """
from omni_core.rewards.plugins import register_reward


def mean_red(image, ground_truth):
    return float(image[..., 0].mean()) / 255.0


register_reward("mean_red", mean_red, owner=__name__)
"""


def _package(root: Path, module: str, source: str, entry: str) -> None:
    """An installed package: its metadata (with one `omni_core.rewards` entry point) and its module, on `root`."""
    info = root / f"{module}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[omni_core.rewards]\n{entry} = {module}\n")
    (root / f"{module}.py").write_text(source)


@pytest.fixture
def site(tmp_path, monkeypatch) -> Path:
    """A folder on sys.path for the packages of one test; what they register is forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugins, "_ADDED", dict(plugins._ADDED))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("plugin_rewards_")]:
        del sys.modules[name]


def test_a_declared_reward_is_imported_on_first_use_and_scores_by_data_source(site):
    _package(site, "plugin_rewards_red", REGISTERS, "mean_red")
    assert plugins.declared_rewards()["mean_red"] == "plugin_rewards_red"
    # Validation knows the name from the metadata alone.
    assert entry_problems("reward.reward_functions[0]", RewardFunctionSpec(name="mean_red")) == []
    assert "plugin_rewards_red" not in sys.modules
    image = np.zeros((8, 8, 3), dtype=np.uint8)
    image[..., 0] = 51  # 51 / 255 = 0.2
    result = RewardManager(None).score([image], ["mean_red"])  # the data_source names it
    assert "plugin_rewards_red" in sys.modules
    assert result.scores.tolist() == pytest.approx([0.2]) and not result.failed.any()
    assert plugins.added_reward_names()["mean_red"] == "plugin_rewards_red"


def test_a_declared_module_that_registers_nothing_is_named(site):
    _package(site, "plugin_rewards_silent", "VALUE = 1\n", "silent")
    with pytest.raises(ValueError, match=r"'silent' is declared by plugin_rewards_silent .*register_reward\('silent'"):
        get_reward_function("silent")


def test_an_unknown_name_lists_the_recipe_rewards_with_their_module():
    (problem,) = entry_problems("reward.reward_functions[0]", RewardFunctionSpec(name="geneval"))
    assert problem.key == "reward.reward_functions[0].name"
    assert "procedural_geneval (omni_core.recipes.procedural_geneval.verifier)" in problem.message
    with pytest.raises(ValueError, match=r"unknown reward 'geneval'.*procedural_geneval \(omni_core\.recipes"):
        get_reward_function("geneval")


def test_a_name_means_one_reward(site):
    def other(image, ground_truth):
        return 0.0

    with pytest.raises(ValueError, match="one of OmniFlow's own"):
        plugins.register_reward("jpeg_compressibility", other, owner="test")
    plugins.register_reward("taken", other, owner="first")
    plugins.register_reward("taken", other, owner="first")  # the same function again (a re-import) is fine
    with pytest.raises(ValueError, match="already registered by first"):
        plugins.register_reward("taken", lambda image, ground_truth: 1.0, owner="second")
