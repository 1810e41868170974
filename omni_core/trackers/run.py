"""Which tracker run a training run logs to: one per checkpoint folder, so that every epoch, retried epoch and
resumed run of that folder continues the same wandb / mlflow run, and a run in another folder starts a new one."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TrackerRun:
    """Where the `wandb` and `mlflow` backends log: `project` (`trainer.project_name`: wandb's project, mlflow's
    experiment), the run's display `name` (`trainer.experiment_name`), its stable `run_id` (`tracker_run_id`), the
    resolved config (wandb's config panel; mlflow's params, flattened) and the checkpoint folder (mlflow's default
    store lives in it)."""

    project: str
    name: str
    run_id: str
    config: dict[str, Any] = field(default_factory=dict)
    checkpoint_dir: Path | None = None


def tracker_run_id(project: str, experiment: str, checkpoint_dir: str | Path) -> str:
    """The tracker run id of a training run: the experiment's name plus a hash of (project, experiment, checkpoint
    folder). wandb uses it as the run id; mlflow (whose stores make their own ids) as the tag `omniflow.run_id`."""
    key = f"{project}\n{experiment}\n{Path(checkpoint_dir).resolve()}"
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", experiment).strip("-")[:40] or "run"
    return f"{slug}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
