"""Pictures a person looks at to judge a run: validation image grids and reward curves (PNG files)."""

from omni_core.reports.images import image_grid, png_data_uri, save_image_grid

__all__ = ["image_grid", "png_data_uri", "save_image_grid"]
