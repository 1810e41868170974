"""Tracking: each backend in `trainer.logger` has what it needs installed, and mlflow a store it accepts."""

from __future__ import annotations

import importlib.util
import os
from urllib.parse import urlparse

from omni_core.config import ConfigProblem, OmniFlowConfig

# Backend -> (the package it needs, how to install it).
BACKEND_PACKAGES = {
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install wandb"),
    "mlflow": ("mlflow", "pip install mlflow-skinny"),
}


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
    if "mlflow" in config.trainer.logger and importlib.util.find_spec("mlflow") is not None:
        p += _mlflow_store_problems(list(config.trainer.logger))
    return p


def _mlflow_store_problems(logger: list[str]) -> list[ConfigProblem]:
    """A `MLFLOW_TRACKING_URI` folder store (`./mlruns`, `file:...`), which mlflow 3 refuses unless
    MLFLOW_ALLOW_FILE_STORE=true: said now, not at the first epoch. Other stores are not contacted here."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri or urlparse(uri).scheme not in ("", "file"):
        return []
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        MlflowClient(tracking_uri=uri)  # builds the store: the folder store's refusal comes from here
    except MlflowException as exc:
        reason = str(exc.message).split(". ")[0]
        return [
            ConfigProblem(
                "trainer.logger",
                f"MLFLOW_TRACKING_URI={uri}: mlflow refuses this store ({reason}); unset MLFLOW_TRACKING_URI (a local "
                "store in the checkpoint folder), point it at sqlite:///<folder>/mlflow.db or a server, or set "
                "MLFLOW_ALLOW_FILE_STORE=true",
                logger,
            )
        ]
    return []
