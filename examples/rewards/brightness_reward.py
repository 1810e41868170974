"""Example custom reward: mean brightness of the image, in [0, 1].

Use it with::

    reward.custom_reward_function.path=examples/rewards/brightness_reward.py \
    reward.custom_reward_function.name=compute_score

It follows verl-omni's contract, ``compute_score(data_source, solution_image, ground_truth,
extra_info)``, where ``solution_image`` is one sample's uint8 pixels (a CHW torch tensor, or an HWC
numpy array). Returning a dict shows how extra per-sample values reach the metrics.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def compute_score(data_source: str, solution_image: Any, ground_truth: Any = None, extra_info: Any = None) -> dict:
    """Mean pixel value / 255 (1.0 = all white); also reports the pixel std as an extra."""
    pixels = np.asarray(solution_image, dtype=np.float32) / 255.0
    return {"score": float(pixels.mean()), "pixel_std": float(pixels.std())}
