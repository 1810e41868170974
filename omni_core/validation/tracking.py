"""Tracking: each backend in `trainer.logger` has what it needs installed."""

from __future__ import annotations

import importlib.util

from omni_core.config import ConfigProblem, OmniFlowConfig

# Backend -> (the package it needs, how to install it).
BACKEND_PACKAGES = {"tensorboard": ("tensorboard", "pip install tensorboard"), "wandb": ("wandb", "pip install wandb")}


def tracking_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    p: list[ConfigProblem] = []
    for backend in config.trainer.logger:
        if backend in BACKEND_PACKAGES:
            package, install = BACKEND_PACKAGES[backend]
            if importlib.util.find_spec(package) is None:
                p.append(
                    ConfigProblem(
                        "trainer.logger",
                        f"the {backend} backend needs the {package!r} package, which is not installed; "
                        f"`{install}` or drop {backend} from trainer.logger",
                        list(config.trainer.logger),
                    )
                )
    return p
