"""Supervised flow-matching training of the procedural model: pre-training to a plateau, and the matched control.

The loss is SD3's rectified flow on pixels: `x_t = (1 - s) x_0 + s e`, the transformer predicts `e - x_0` at timestep
`1000 s` (`s` uniform in [0, 1]), conditioned on the frozen text encoders' embeddings of the image's caption
(computed once for the 120 prompts). AdamW, a fixed learning rate, batches drawn uniformly from the training set.

- `pretrain_to_plateau` trains a fresh model and evaluates it every `eval_every_steps` steps on all scenes
  (`evaluation.evaluate_scenes`); it stops when the mean of the per-attribute accuracies on seen combinations has not
  improved by `min_delta` for `patience` evaluations (its supervised plateau; not before `min_steps`: early on the
  model has not yet learnt to draw one clean object and the metric wanders), or at `max_seconds`. The base folder it
  writes is a whole pipeline (`load_pipeline` reads it) plus `supervised_state.pt` (the optimizer, for the control)
  and `pretrain.json` (the evaluation history). Progress is checkpointed at every evaluation
  (`<out>.partial/state.pt`), and a run restarted with the same design resumes from it; a finished base with the same
  design fingerprint is reused as is.
- `continue_supervised` is the matched control: the same training, from the base with its optimizer state, for a
  wall-clock budget; it writes its own pipeline folder and reports the seconds and steps it spent.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from omni_core.models.policy import FlowPolicy
from omni_core.recipes.procedural_geneval.data import DataDesign, build_training_set
from omni_core.recipes.procedural_geneval.evaluation import MAX_SEQUENCE_LENGTH, evaluate_scenes
from omni_core.recipes.procedural_geneval.scenes import all_scenes
from omni_core.recipes.procedural_geneval.verifier import ATTRIBUTES

__all__ = ["SupervisedResult", "SupervisedSettings", "continue_supervised", "default_device", "pretrain_to_plateau"]

STATE_FILE = "supervised_state.pt"
SUMMARY_FILE = "pretrain.json"


@dataclass(frozen=True)
class SupervisedSettings:
    """Optimisation and stopping of the supervised training."""

    lr: float = 5e-4
    batch_size: int = 128
    eval_every_steps: int = 150
    min_steps: int = 600
    patience: int = 2
    min_delta: float = 0.01
    max_seconds: float = 600.0
    eval_samples_per_prompt: int = 2
    seed: int = 0


@dataclass
class SupervisedResult:
    """What a supervised stage did: its model folder, steps, wall seconds, the evaluation history and why it stopped."""

    model_dir: str
    steps: int
    seconds: float
    stopped: str
    history: list[dict] = field(default_factory=list)
    last_step_began: float | None = None  # seconds into the stage when its last step started (the control's stop rule)

    def to_json(self) -> dict:
        return asdict(self)


def default_device() -> str:
    """Where the supervised stages and evaluations run: the first CUDA device when there is one, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


class _Trainer:
    """The model, its optimizer, the data as tensors and the caption embeddings; `step()` is one AdamW step."""

    def __init__(self, model_dir: Path, design: DataDesign, settings: SupervisedSettings, threads: int | None = None):
        if threads:
            torch.set_num_threads(threads)
        self.settings = settings
        self.policy = FlowPolicy(model_dir, device=default_device())
        self.transformer = self.policy.transformer.train()
        data = build_training_set(design, settings.seed)
        self.images = (torch.from_numpy(data.images).permute(0, 3, 1, 2).float() / 127.5 - 1.0).to(self.policy.device)
        index = {s: i for i, s in enumerate(all_scenes())}
        self.caption_ids = torch.tensor([index[s] for s in data.captions], device=self.policy.device)
        cond = self.policy.encode_prompts([s.prompt for s in all_scenes()], max_sequence_length=MAX_SEQUENCE_LENGTH)
        self.embeds, self.pooled = cond["prompt_embeds"], cond["pooled_prompt_embeds"]
        self.optimizer = torch.optim.AdamW(self.transformer.parameters(), lr=settings.lr)
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.steps = 0

    def step(self) -> float:
        n, g = self.settings.batch_size, self.generator
        device = self.policy.device
        pick = torch.randint(0, len(self.images), (n,), generator=g).to(device)
        x0, ids = self.images[pick], self.caption_ids[pick]
        s = torch.rand(n, generator=g).to(device)
        noise = torch.randn(x0.shape, generator=g).to(device)
        xt = (1 - s)[:, None, None, None] * x0 + s[:, None, None, None] * noise
        velocity = self.transformer(
            hidden_states=xt,
            timestep=s * 1000,
            encoder_hidden_states=self.embeds[ids],
            pooled_projections=self.pooled[ids],
            return_dict=False,
        )[0]
        loss = torch.nn.functional.mse_loss(velocity, noise - x0)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.steps += 1
        return float(loss.detach())

    def state(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
            "steps": self.steps,
        }

    def load_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.steps = int(state["steps"])

    def save_model(self, template_dir: Path, out_dir: Path, extra: dict) -> None:
        """The whole pipeline folder (`template_dir`'s components, this transformer) and the optimizer state, written
        to a temporary folder and moved into place, so a crash never leaves half a model at `out_dir`."""
        tmp = out_dir.with_name(out_dir.name + ".writing")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(template_dir, tmp, ignore=shutil.ignore_patterns("transformer", STATE_FILE, SUMMARY_FILE))
        self.policy.base_transformer.save_pretrained(tmp / "transformer", safe_serialization=True)
        torch.save(self.state(), tmp / STATE_FILE)
        (tmp / SUMMARY_FILE).write_text(json.dumps(extra, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)


def _plateau_metric(summary: dict) -> float:
    return float(np.mean([summary["overall"][a]["seen"] for a in ATTRIBUTES]))


def _evaluate(trainer: _Trainer, design: DataDesign, elapsed: float) -> dict:
    _, held = design.split()
    summary = evaluate_scenes(trainer.policy, held, samples_per_prompt=trainer.settings.eval_samples_per_prompt).summary(
        design.biases
    )
    return {"step": trainer.steps, "seconds": round(elapsed, 2), "metric": _plateau_metric(summary), "summary": summary}


def pretrain_to_plateau(
    init_dir: str | Path,
    out_dir: str | Path,
    design: DataDesign,
    settings: SupervisedSettings = SupervisedSettings(),  # noqa: B008  (frozen)
    threads: int | None = None,
    on_evaluation: Callable[[dict], None] | None = None,
) -> SupervisedResult:
    """Train the model in `init_dir` on the design's data until its plateau; write the base pipeline to `out_dir`."""
    init_dir, out_dir = Path(init_dir), Path(out_dir)
    key = {"design": design.fingerprint(), "settings": asdict(settings)}
    summary_file = out_dir / SUMMARY_FILE
    if summary_file.is_file():
        done = json.loads(summary_file.read_text())
        if done.get("key") == key:
            return SupervisedResult(**done["result"])
        raise FileExistsError(
            f"{out_dir} holds a base model pre-trained with another design or settings; choose another folder "
            "(nothing there is overwritten)"
        )
    partial = out_dir.with_name(out_dir.name + ".partial")
    trainer = _Trainer(init_dir, design, settings, threads)
    history: list[dict] = []
    spent = 0.0
    if (partial / "state.pt").is_file():
        saved = torch.load(partial / "state.pt", weights_only=False)
        if saved["key"] == key:
            trainer.transformer.load_state_dict(saved["transformer"])
            trainer.load_state(saved["trainer"])
            history, spent = saved["history"], saved["seconds"]
    best, stale = -1.0, 0
    for h in history:  # replay the stopping rule over a resumed history
        best, stale = (h["metric"], 0) if h["metric"] > best + settings.min_delta else (best, stale + 1)
    start = time.monotonic() - spent
    stopped = "max_seconds"
    while time.monotonic() - start < settings.max_seconds:
        trainer.step()
        if trainer.steps % settings.eval_every_steps:
            continue
        record = _evaluate(trainer, design, time.monotonic() - start)
        history.append(record)
        if on_evaluation is not None:
            on_evaluation(record)
        best, stale = (record["metric"], 0) if record["metric"] > best + settings.min_delta else (best, stale + 1)
        partial.mkdir(parents=True, exist_ok=True)
        state = {
            "key": key,
            "transformer": trainer.transformer.state_dict(),
            "trainer": trainer.state(),
            "history": history,
            "seconds": time.monotonic() - start,
        }
        torch.save(state, partial / "state.pt.tmp")
        os.replace(partial / "state.pt.tmp", partial / "state.pt")
        if stale >= settings.patience and trainer.steps >= settings.min_steps:
            stopped = "plateau"
            break
    if not history or history[-1]["step"] != trainer.steps:
        history.append(_evaluate(trainer, design, time.monotonic() - start))
    result = SupervisedResult(str(out_dir), trainer.steps, round(time.monotonic() - start, 2), stopped, history)
    trainer.save_model(init_dir, out_dir, {"key": key, "result": result.to_json()})
    shutil.rmtree(partial, ignore_errors=True)
    return result


def continue_supervised(
    base_dir: str | Path,
    out_dir: str | Path,
    design: DataDesign,
    budget_seconds: float,
    settings: SupervisedSettings = SupervisedSettings(),  # noqa: B008  (frozen)
    threads: int | None = None,
) -> SupervisedResult:
    """The matched control: more supervised training from the base (its weights and optimizer state) for
    `budget_seconds` of wall time, written to `out_dir` (which must not exist: nothing saved is overwritten)."""
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; the control writes a new folder and never overwrites one")
    trainer = _Trainer(base_dir, design, settings, threads)
    if (base_dir / STATE_FILE).is_file():
        trainer.load_state(torch.load(base_dir / STATE_FILE, weights_only=False))
    first_step = trainer.steps
    start = time.monotonic()
    last_step_began = None
    while (elapsed := time.monotonic() - start) < budget_seconds:
        last_step_began = elapsed
        trainer.step()
    seconds = round(time.monotonic() - start, 2)
    result = SupervisedResult(
        str(out_dir), trainer.steps - first_step, seconds, "budget", last_step_began=round(last_step_began or 0.0, 2)
    )
    trainer.save_model(base_dir, out_dir, {"result": result.to_json(), "budget_seconds": budget_seconds})
    return result
