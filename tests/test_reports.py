"""Pictures for people: image grids, the reward curve and its verdict, and the run's artifacts that show them."""

from __future__ import annotations

import asyncio
import math
import re

import pytest
import torch
from PIL import Image

from omni_core.reports import image_grid, png_data_uri, reward_trend, save_image_grid, save_reward_curve, step_noise, trend_line


def test_image_grid_puts_each_image_in_its_tile():
    images = torch.stack([torch.full((3, 4, 5), 10 * i, dtype=torch.uint8) for i in range(5)])  # 5 images, 4x5 px
    grid = image_grid(images, ncols=2, pad=1)
    # 2 columns x 3 rows of 5x4 tiles with 1 px padding around each: (2*5+3) x (3*4+4)
    assert grid.size == (13, 16)
    # image 3 sits in row 1, column 1: its top-left pixel at x = 1 + 1*(5+1), y = 1 + 1*(4+1)
    assert grid.getpixel((7, 6)) == (30, 30, 30)
    assert grid.getpixel((0, 0)) == (255, 255, 255)  # padding
    assert grid.getpixel((7, 11)) == (255, 255, 255)  # the empty 6th tile: row 2, column 1


def test_save_image_grid_writes_a_png_and_its_data_uri(tmp_path):
    path = save_image_grid(torch.zeros(4, 3, 8, 8, dtype=torch.uint8), tmp_path / "a" / "g.png", ncols=4)
    assert Image.open(path).size == (4 * 8 + 5 * 2, 8 + 2 * 2)
    assert png_data_uri(path).startswith("data:image/png;base64,iVBORw0KGgo")  # the PNG signature, base64


def test_step_noise_ignores_a_steady_trend_and_measures_the_jitter():
    assert step_noise([0.1 * t for t in range(20)]) == pytest.approx(0.0, abs=1e-12)  # a pure trend is no noise
    # [0, 1, 0, 1]: differences 1, -1, 1 (mean 1/3); sum of squared deviations 24/9, / 2 dof, / 2 -> 2/3.
    assert step_noise([0, 1, 0, 1]) == pytest.approx(math.sqrt(2 / 3))
    assert step_noise([5, 6, 5, 6]) == pytest.approx(step_noise([0, 1, 0, 1]))  # shift-free
    assert math.isnan(step_noise([1.0, 2.0]))


def test_reward_trend_compares_first_and_last_three_steps():
    # first 3: (1+2+3)/3 = 2; last 3: (4+5+6)/3 = 5 -> up
    assert reward_trend([1, 2, 3, 4, 5, 6]) == (2.0, 5.0, "up")
    assert reward_trend([6, 5, 4, 3, 2, 1])[2] == "down"
    assert reward_trend([1.0, 1.0])[2] == "flat"
    assert math.isnan(reward_trend([])[0])
    assert trend_line([-0.009, -0.0088, -0.0087, -0.0085]) == "mean reward -0.008833 -> -0.008667 (up)"


def test_reward_curve_png(tmp_path):
    steps = [
        {"training/global_step": s, "critic/rewards/mean": 0.1 * s, "critic/rewards/min": 0.0, "critic/rewards/max": 1.0}
        for s in (1, 2, 3)
    ]
    path = save_reward_curve(steps, tmp_path / "curve.png", val_points=[(0, 0.05), (3, 0.3)], title="t")
    assert Image.open(path).size == (640, 360)


# ----------------------------------------------------------------------------- in a real run
def _artifacts_of(flow_run_id) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
    )

    async def read():
        async with get_client() as client:
            children = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
            )
            ids = [flow_run_id, *(c.id for c in children)]
            return await client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=ids)))

    return asyncio.run(read())


@pytest.mark.timeout(600)
def test_a_run_shows_validation_grids_reward_curve_and_summary(flow_reference):
    state, result, ckpt = flow_reference
    # val_before_train: one validation at step 0 of the 1 validation prompt x val_kwargs.n samples, 32 px tiles.
    grid = ckpt / "validation" / "global_step_0.png"
    from omni_core.config import load_config

    n = load_config([], []).actor_rollout_ref.rollout.val_kwargs.n
    assert Image.open(grid).size == (n * 32 + (n + 1) * 2, 32 + 2 * 2)
    curve = ckpt / "logs" / result.run_id / "reward_curve.png"
    assert Image.open(curve).size == (640, 360)

    arts = _artifacts_of(state.state_details.flow_run_id)
    by_key: dict[str, list] = {}
    for a in arts:
        by_key.setdefault(a.key, []).append(a)
    (val,) = by_key["omniflow-validation"]
    assert "data:image/png;base64," in val.data and str(grid.resolve()) in val.data
    assert "val-core/" in val.data and re.fullmatch(r"Validation at step 0: reward -?\d+\.\d{6}", val.description)
    curves = by_key["omniflow-reward-curve"]
    assert len(curves) == 2  # redrawn after each of the 2 epochs
    assert all("data:image/png;base64," in c.data and c.description.startswith("mean reward ") for c in curves)
    (summary,) = by_key["omniflow-run-summary"]
    assert summary.flow_run_id == state.state_details.flow_run_id  # on the main run's own page
    first, last = result.reward_first, result.reward_last  # the flow's own first / last 3-step means
    verdict = "up" if last > first else "down" if last < first else "flat"
    assert f"({verdict})" in summary.description and summary.data.count("data:image/png;base64,") == 2
