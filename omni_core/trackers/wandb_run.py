"""The `wandb` backend: one wandb run per checkpoint folder (`TrackerRun.run_id`), continued by every epoch (each
a Prefect task that opens and finishes it), retried epoch and resume; offline under `<log dir>/wandb` for
`wandb sync` when no API key is configured, so training never waits on a login prompt.

wandb itself prints nothing (`silent`: its three banner lines per epoch, `offline-run-...`, `wandb sync`,
`wandb leet`, would repeat on the console every epoch; they go to the run's own debug log instead); the tracker
says once, in one line of the run's console, where the run is (`where`)."""

from __future__ import annotations

import netrc
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import urlparse

import torch

from omni_core.trackers.run import TrackerRun


def wandb_mode() -> str | None:
    """`WANDB_MODE` when it is set (None: wandb reads it); else `online` with an API key (`WANDB_API_KEY`, or a
    ~/.netrc entry for the wandb host that `wandb login` writes) and `offline` without one: the run is kept under
    `<log dir>/wandb/offline-run-*` for `wandb sync`, and training never waits on a login prompt."""
    if os.environ.get("WANDB_MODE"):
        return None
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        if host and netrc.netrc().authenticators(host):
            return "online"
    except (OSError, netrc.NetrcParseError):
        pass
    return "offline"


class WandbTracker:
    """One epoch's handle on the training run's wandb run (resumed when it exists)."""

    def __init__(self, run: TrackerRun, log_dir: Path):
        import wandb

        log_dir.mkdir(parents=True, exist_ok=True)
        # console="off": wandb leaves the process's stdout alone; no system-metrics sampler (it would take CPU from
        # the step on a small machine); silent: no banner lines on the console (see the module docstring).
        settings = wandb.Settings(console="off", x_disable_stats=True, quiet=True, silent=True)
        self.run = wandb.init(
            project=run.project,
            name=run.name,
            id=run.run_id,
            resume="allow",
            dir=str(log_dir),
            mode=wandb_mode(),
            config=run.config,
            settings=settings,
        )

    @property
    def where(self) -> str:
        """One line: the run's page online, its folder and the upload command offline, or that it is disabled."""
        if self.run.disabled:
            return "wandb disabled (WANDB_MODE=disabled): nothing is logged to wandb"
        if self.run.offline:
            folder = Path(self.run.dir).parent  # <log dir>/wandb/offline-run-<time>-<id>; run.dir is its files/
            return f"wandb run {self.run.id} offline in {folder.parent} (`wandb sync {folder.parent}/offline-run-*-{self.run.id}*` uploads it)"
        return f"wandb run {self.run.id}: {self.run.url}"

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_images(self, step: int, images: torch.Tensor, captions: Sequence[str]) -> str:
        """uint8 `[N, 3, H, W]` as `val/generations` (a wandb.Image list with captions); says where they went."""
        import wandb

        pictures = [wandb.Image(image.permute(1, 2, 0).numpy(), caption=c) for image, c in zip(images, captions, strict=True)]
        self.run.log({"val/generations": pictures}, step=step)
        return f"wandb run {self.run.id} (val/generations)"

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)
