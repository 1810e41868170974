"""Metrics: verl-omni's per-step data metrics and the tracking backends (`trainer.logger`).

Backends: `console` (one line per step with a progress bar, to stdout or to a line sink such as the
Prefect run's log), `file` (JSONL, one record per step), `tensorboard` (torch's SummaryWriter), `wandb` and
`mlflow` (`omni_core/trackers/`: one tracker run per checkpoint folder, continued by the run's epochs, retried
epochs and resumes; wandb offline under `<log dir>/wandb` without an API key, mlflow in a local store in the
checkpoint folder unless MLFLOW_TRACKING_URI says otherwise). Names follow verl-omni (`critic/rewards/mean`,
`actor/pg_loss`, `timing_s/gen`, `perf/throughput`, ...). Validation images (`trainer.log_val_generations`)
go to the same backends through `Tracking.log_images`: PNG files plus a JSONL index, TensorBoard images
with their captions, wandb images, mlflow images, and a console line that says where they went. At the end of
training `Tracking.log_model` hands the final model to mlflow as an artifact.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from omni_core.checkpoint.layout import ACTOR_DIR
from omni_core.trackers.run import TrackerRun, tracker_run_id
from omni_core.trackers.wandb_run import wandb_mode  # noqa: F401  (re-exported: the wandb mode rule)

# Earlier names of the tracker run (it served wandb alone), kept for callers that still use them.
WandbRun = TrackerRun
wandb_run_id = tracker_run_id
# The final model inside a checkpoint: the training actor's `save_pretrained` folder (what `export_checkpoint` exports).
MODEL_DIR = f"{ACTOR_DIR}/hf"


def data_metrics(rewards: torch.Tensor, advantages: torch.Tensor, group_index: torch.Tensor) -> dict[str, float]:
    """critic/rewards/*, critic/advantages/* and the share of groups whose rewards are all equal."""
    rewards, advantages = rewards.float(), advantages.float()
    groups = torch.unique(group_index)
    zero_std = sum(int(rewards[group_index == g].std(unbiased=False).item() == 0.0) for g in groups)
    return {
        "critic/rewards/mean": rewards.mean().item(),
        "critic/rewards/max": rewards.max().item(),
        "critic/rewards/min": rewards.min().item(),
        "critic/advantages/mean": advantages.mean().item(),
        "critic/advantages/max": advantages.max().item(),
        "critic/advantages/min": advantages.min().item(),
        "critic/rewards/zero_std_ratio": zero_std / max(len(groups), 1),
    }


def timing_metrics(timing: Mapping[str, float], num_images: int, n_devices: int = 1) -> dict[str, float]:
    """timing_s/* plus perf/throughput (images per second per device over the whole step)."""
    out = {f"timing_s/{k}": float(v) for k, v in timing.items()}
    step_time = timing.get("step", 0.0)
    out["perf/total_num_images"] = float(num_images)
    out["perf/time_per_step"] = float(step_time)
    out["perf/throughput"] = num_images / (step_time * n_devices) if step_time > 0 else 0.0
    return out


class Timer:
    """`with timer("gen"):` accumulates wall seconds into `timer.timing["gen"]`."""

    def __init__(self) -> None:
        self.timing: dict[str, float] = {}

    def __call__(self, name: str) -> _Span:
        return _Span(self, name)


class _Span:
    def __init__(self, timer: Timer, name: str):
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.timer.timing[self.name] = self.timer.timing.get(self.name, 0.0) + time.perf_counter() - self.start


ETA_WINDOW = 10  # the console's ETA: the mean time of this many last steps, times the steps left


def format_duration(seconds: float) -> str:
    """`42s`, `3m05s`, `2h07m`: a console duration."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Tracking:
    """Logs step metrics, validation images and the final model to the backends named in `trainer.logger`."""

    def __init__(
        self,
        backends: Sequence[str],
        log_dir: str | Path,
        total_steps: int,
        stream: Any = None,
        console_sink: Callable[[str], None] | None = None,
        resume_step: int | None = None,
        run: TrackerRun | None = None,
        started_at: float | None = None,
    ):
        """`console` lines go to `console_sink` when given, else to `stream` (default stdout), with the time since
        `started_at` (wall clock, the run's start) and an ETA from the mean of the last steps' times. `run`: the
        tracker run the `wandb` and `mlflow` backends log to (required with either).

        `resume_step`: the step a (retried or resumed) epoch restarts from. Records of later steps, written by
        the try that failed, are dropped (metrics.jsonl and val_generations.jsonl rewritten without them;
        TensorBoard told with `purge_step`), so that every step ends with one record. At 0 every record goes
        (step 0 holds validation before training, which the new try logs again). wandb and mlflow keep a run's
        history append-only: they keep the failed try's record of a step they already have and drop the new one
        (on a CPU run the two are bit-identical). When a run starts (`resume_step` None or 0) the console says in
        one line where the wandb / mlflow run is.
        """
        self.backends = list(backends)
        self.log_dir = Path(log_dir)
        self.total_steps = total_steps
        self.started_at = started_at
        self._step_seconds: list[float] = []  # timing_s/step of the steps logged, for the console's ETA
        self.stream = stream or sys.stdout
        self.console_sink = console_sink
        self._tb = None
        purge_from = None if resume_step is None else (resume_step + 1 if resume_step > 0 else 0)
        if "file" in self.backends or "tensorboard" in self.backends:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        if "file" in self.backends and purge_from is not None:
            for path in (self.jsonl_path, self.images_jsonl_path):
                _drop_records_from(path, purge_from)
        if "tensorboard" in self.backends:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.log_dir / "tensorboard"), purge_step=purge_from)
        self._trackers: list[Any] = []  # WandbTracker / MlflowTracker: log, log_images, close (+ mlflow's log_model)
        self._mlflow = None
        self._mlflow_run_id: str | None = None
        try:
            self._start_trackers(run)
        except BaseException:  # e.g. an mlflow server that does not answer: what did start is closed
            self.close(failed=True)
            raise
        if "console" in self.backends:
            for note in self._mlflow.notes if self._mlflow is not None else []:
                self._say(note)
            if self._trackers and not resume_step:
                self._say("tracking: " + "; ".join(t.where for t in self._trackers))

    def _start_trackers(self, run: TrackerRun | None) -> None:
        needs_run = [b for b in ("wandb", "mlflow") if b in self.backends]
        if needs_run and run is None:
            raise ValueError(f"the {' and '.join(needs_run)} backend needs a TrackerRun (project, name, run id, config)")
        if "wandb" in self.backends:
            from omni_core.trackers.wandb_run import WandbTracker

            self._trackers.append(WandbTracker(run, self.log_dir))
        if "mlflow" in self.backends:
            from omni_core.trackers.mlflow_run import MlflowTracker

            self._mlflow = MlflowTracker(run)
            self._mlflow_run_id = self._mlflow.run_id
            self._trackers.append(self._mlflow)

    @property
    def jsonl_path(self) -> Path:
        return self.log_dir / "metrics.jsonl"

    @property
    def images_dir(self) -> Path:
        """Where the `file` backend writes validation images: `<log_dir>/val_generations/step_<N>_<i>.png`."""
        return self.log_dir / "val_generations"

    @property
    def images_jsonl_path(self) -> Path:
        """The `file` backend's index of validation images: one row per `log_images` call."""
        return self.log_dir / "val_generations.jsonl"

    @property
    def mlflow_run_id(self) -> str | None:
        """The mlflow store's id of the run (None without the mlflow backend)."""
        return self._mlflow_run_id

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}
        if "console" in self.backends:
            self._say(self._console_line(clean, step))
        if "file" in self.backends:
            with self.jsonl_path.open("a") as f:
                f.write(json.dumps({"step": step, **clean}) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        for tracker in self._trackers:
            tracker.log(clean, step)

    def log_images(self, step: int, images: torch.Tensor, captions: Sequence[str]) -> None:
        """Validation images (uint8 `[N, 3, H, W]`, one caption each) to every backend of `trainer.logger`.

        file: `val_generations/step_<step>_<i>.png` next to metrics.jsonl and a row
        `{"step", "images": [{"path", "caption"}]}` (paths relative to the log folder) in
        val_generations.jsonl; tensorboard: image `val/generations/<i>` with its caption as the text
        `val/generations/<i>/caption`; wandb: `val/generations`, a list of images with captions; mlflow: images
        `val/generations/<i>` and `val_generations/step_<step>.json` with the captions; console: one line saying
        how many went where.
        """
        if images.ndim != 4 or images.shape[1] != 3 or images.dtype != torch.uint8:
            raise ValueError(f"log_images takes uint8 images [N, 3, H, W], got {images.dtype} {tuple(images.shape)}")
        if len(captions) != images.shape[0]:
            raise ValueError(f"{images.shape[0]} images but {len(captions)} captions")
        if images.shape[0] == 0:
            return
        images = images.detach().cpu()
        where = []
        if "file" in self.backends:
            from PIL import Image

            self.images_dir.mkdir(parents=True, exist_ok=True)
            entries = []
            for i, (image, caption) in enumerate(zip(images, captions, strict=True)):
                path = self.images_dir / f"step_{step}_{i}.png"
                Image.fromarray(image.permute(1, 2, 0).numpy()).save(path)
                entries.append({"path": path.relative_to(self.log_dir).as_posix(), "caption": caption})
            with self.images_jsonl_path.open("a") as f:
                f.write(json.dumps({"step": step, "images": entries}) + "\n")
            where.append(str(self.images_dir))
        if self._tb is not None:
            for i, (image, caption) in enumerate(zip(images, captions, strict=True)):
                self._tb.add_image(f"val/generations/{i}", image, step, dataformats="CHW")
                self._tb.add_text(f"val/generations/{i}/caption", caption, step)
            self._tb.flush()
            where.append(f"tensorboard {self.log_dir / 'tensorboard'} (val/generations/*)")
        where += [tracker.log_images(step, images, captions) for tracker in self._trackers]
        if "console" in self.backends:
            self._say(
                f"step {step}: {images.shape[0]} validation image(s) -> "
                + ("; ".join(where) if where else "not stored (add file, tensorboard, wandb or mlflow to trainer.logger)")
            )

    def log_model(self, checkpoint: str | Path, step: int) -> None:
        """The final model of training, the checkpoint's `actor/hf` folder (the transformer's `save_pretrained`
        folder, or the LoRA adapter), to mlflow as the artifact folder `model/`; the other backends keep no model."""
        if self._mlflow is None:
            return
        where = self._mlflow.log_model(Path(checkpoint) / MODEL_DIR, step)
        if "console" in self.backends:
            self._say(f"final model (step {step}) -> {where}")

    def _say(self, line: str) -> None:
        if self.console_sink is not None:
            self.console_sink(line)
        else:
            self.stream.write(line + "\n")
            self.stream.flush()

    def _console_line(self, m: Mapping[str, float], step: int) -> str:
        width = 20
        done = min(step, self.total_steps) if self.total_steps else step
        filled = int(width * done / self.total_steps) if self.total_steps else 0
        bar = "#" * filled + "." * (width - filled)
        # The reward, then each loss family's own (policy gradient, Diffusion-DPO, distillation), then the gradient.
        keys = (
            "critic/rewards/mean",
            "actor/pg_loss",
            "actor/ppo_kl",
            "actor/dpo_loss",
            "actor/rewards/margins",
            "actor/distill_kl_loss",
            "actor/distill_fm_mse_loss",
            "actor/grad_norm",
        )
        parts = [f"{k.split('/', 1)[1]}={m[k]:.4g}" for k in keys if k in m]
        if "timing_s/step" in m:
            self._step_seconds.append(float(m["timing_s/step"]))
            parts.append(f"step_time={m['timing_s/step']:.1f}s")
        parts += [f"{k}={v:.4g}" for k, v in m.items() if k.startswith("val-core/")]
        if self.started_at is not None:
            parts.append(f"elapsed {format_duration(time.time() - self.started_at)}")
        if self._step_seconds and self.total_steps and step < self.total_steps:
            recent = self._step_seconds[-ETA_WINDOW:]
            parts.append(f"ETA {format_duration(sum(recent) / len(recent) * (self.total_steps - step))}")
        return f"[{bar}] step {step}/{self.total_steps} {' '.join(parts)}".rstrip()

    def close(self, failed: bool = False) -> None:
        """Flush and close every backend; `failed`: the epoch ended with an error (wandb exit code 1, mlflow
        status FAILED). Closing twice is harmless."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        for tracker in self._trackers:
            tracker.close(failed)
        self._trackers, self._mlflow = [], None


def _drop_records_from(path: Path, step: int) -> None:
    """Rewrite the JSONL file `path` without its records of `step` and later (atomically: a temporary file
    renamed over it, so a kill mid-rewrite leaves the old file whole)."""
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line).get("step", -1) < step]
    if len(kept) == len([line for line in lines if line.strip()]):
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


def read_jsonl(path: str | Path) -> list[dict[str, float]]:
    """The records a `file` backend wrote."""
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []
