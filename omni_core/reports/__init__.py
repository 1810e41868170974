"""Pictures a person looks at to judge a run: validation image grids and reward curves (PNG files)."""

from omni_core.reports.images import MAX_EMBEDDED_PNG_BYTES, image_grid, markdown_image, png_data_uri, save_image_grid
from omni_core.reports.plots import reward_trend, save_reward_curve, step_noise, trend_line

__all__ = [
    "MAX_EMBEDDED_PNG_BYTES",
    "image_grid",
    "markdown_image",
    "png_data_uri",
    "reward_trend",
    "save_image_grid",
    "save_reward_curve",
    "step_noise",
    "trend_line",
]
