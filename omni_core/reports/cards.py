"""What the run's artifacts say: markdown cards and table rows built from the run's records.

No Prefect here: the tasks publish these as artifacts (`tasks/fit_epoch.py`, `tasks/publish_reports.py`,
the pipeline's `evaluate`). Pictures are embedded as data URIs up to a size, so the Prefect UI shows them
without a file server, and linked above it (`markdown_image`); the PNG files stay on disk next to the checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omni_core.checkpoint import checkpoint_summary
from omni_core.records import EpochResult, RunInfo
from omni_core.reports.images import markdown_image
from omni_core.reports.plots import save_reward_curve, trend_line

REWARD_CURVE = "reward_curve.png"  # in the run's log folder
# The columns of the per-epoch metrics table (verl-omni names; the table shows the last path part).
TABLE_COLUMNS = (
    "training/global_step",
    "critic/rewards/mean",
    "critic/rewards/max",
    "critic/rewards/min",
    "critic/advantages/max",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/grad_norm",
    "actor/lr",
    "timing_s/step",
    "perf/throughput",
)


@dataclass(frozen=True)
class Card:
    """A markdown artifact: its body, and the one line the run page's artifact card shows."""

    markdown: str
    description: str


def _metrics_lines(metrics: dict[str, float]) -> str:
    return "\n".join(f"| {k} | {v:.6f} |" for k, v in sorted(metrics.items()))


def validation_reward(metrics: dict[str, float]) -> float | None:
    """The mean of a validation's `val-core/<data source>/reward/mean@n` values (None if it has none)."""
    rewards = [v for k, v in metrics.items() if k.startswith("val-core/")]
    return sum(rewards) / len(rewards) if rewards else None


def _step_rewards(epochs: list[EpochResult]) -> tuple[list[dict[str, float]], list[float]]:
    steps = [m for e in epochs for m in e.step_metrics]
    return steps, [m["critic/rewards/mean"] for m in steps if "critic/rewards/mean" in m]


def _val_points(epochs: list[EpochResult]) -> list[tuple[int, float]]:
    points = [(step, validation_reward(metrics)) for e in epochs for step, _, metrics in e.val_grids]
    return [(step, r) for step, r in points if r is not None]


def validation_cards(result: EpochResult) -> list[Card]:
    """One card per validation of the epoch: its image grid (rows: prompts) and metrics."""
    cards = []
    for step, path, metrics in result.val_grids:
        reward = validation_reward(metrics)
        cards.append(
            Card(
                markdown=(
                    f"### Validation samples at step {step}\n\nRows: prompts; columns: samples (noise 0, fixed seeds).\n\n"
                    f"{markdown_image(path, f'validation samples, step {step}')}\n\n| metric | value |\n|---|---|\n"
                    f"{_metrics_lines(metrics)}\n\nPNG: `{path}`\n"
                ),
                description=f"Validation at step {step}" + (f": reward {reward:.6f}" if reward is not None else ""),
            )
        )
    return cards


def epoch_metrics_rows(result: EpochResult) -> list[dict[str, float]]:
    """One table row per step (the `TABLE_COLUMNS`), plus a row of the epoch's validation metrics."""
    rows = [
        {k.split("/")[-1] if k != "training/global_step" else "step": round(m.get(k, float("nan")), 6) for k in TABLE_COLUMNS}
        for m in result.step_metrics
    ]
    if result.val_metrics:
        rows.append({"step": result.global_step, **{k: round(v, 6) for k, v in result.val_metrics.items()}})
    return rows


def checkpoint_card(result: EpochResult) -> Card | None:
    """Path, step, size and manifest hash of the epoch's checkpoint (None when it wrote none)."""
    if not result.checkpoint:
        return None
    s = checkpoint_summary(result.checkpoint)
    return Card(
        markdown=(
            f"### Checkpoint of epoch {result.epoch}\n\n| | |\n|---|---|\n| path | `{s['path']}` |\n| step | {s['step']} |\n"
            f"| size | {s['size_bytes'] / 1e6:.2f} MB ({s['num_files']} files) |\n| sha256 (manifest) | `{s['sha256']}` |\n"
        ),
        description=f"global_step_{s['step']}",
    )


def reward_curve_card(run: RunInfo, epochs: list[EpochResult], end_epoch: int) -> Card:
    """Redraws `<log_dir>/reward_curve.png` from every epoch so far and shows it with the trend."""
    steps, rewards = _step_rewards(epochs)
    path = save_reward_curve(steps, Path(run.log_dir) / REWARD_CURVE, _val_points(epochs), title=run.run_id)
    line = trend_line(rewards)
    done = epochs[-1].epoch + 1 if epochs else 0
    return Card(
        markdown=f"### Reward curve after epoch {done}/{end_epoch}: {line}\n\n{markdown_image(path, 'reward curve')}\n\nPNG: `{path}`\n",
        description=line,
    )


def already_complete_note(experiment: str, global_step: int) -> str:
    """What a run that resumed an experiment past its last step says (it trained nothing), and how to start anew."""
    return (
        f"experiment {experiment!r} was already complete at step {global_step}: its last checkpoint is the run's last step, so "
        "this run started nothing and trained nothing; start a new experiment with trainer.experiment_name=<new name> (or, from a deployment's form, "
        "new_experiment_per_run=true)"
    )


def run_summary_card(
    run: RunInfo, epochs: list[EpochResult], final_checkpoint: str | None, global_step: int, note: str | None = None
) -> Card:
    """The run's verdict: trend, steps, last checkpoint, the reward curve and the last validation grid; `note` (a run
    that trained nothing: `already_complete_note`) comes first and is the card's description."""
    steps, rewards = _step_rewards(epochs)
    line = trend_line(rewards)
    parts = [f"### {run.run_id}: {line}\n", f"Steps trained: {global_step}; last checkpoint: `{final_checkpoint}`\n"]
    if note is not None:
        parts.insert(0, f"**Nothing trained**: {note}\n")
        line = f"Nothing trained: {note}"
    if steps:
        curve = save_reward_curve(steps, Path(run.log_dir) / REWARD_CURVE, _val_points(epochs), title=run.run_id)
        parts.append(f"{markdown_image(curve, 'reward curve')}\n")
    grids = [g for e in epochs for g in e.val_grids]
    if grids:
        step, path, _ = grids[-1]
        parts.append(f"Last validation samples (step {step}):\n\n{markdown_image(path, 'validation samples')}\n")
    return Card(markdown="\n".join(parts), description=line)


def evaluation_card(
    before: float,
    after: float,
    grid_before: str,
    grid_after: str,
    num_prompts: int,
    samples_per_prompt: int,
    seed: int,
    checkpoint: str,
) -> Card:
    """The pipeline's before / after evaluation: mean rewards and both grids."""
    return Card(
        markdown=(
            f"### Evaluation: mean reward {before:.6f} -> {after:.6f} ({after - before:+.6f})\n\n"
            f"{num_prompts} prompts x {samples_per_prompt} samples, seed {seed}; checkpoint `{checkpoint}`.\n\n"
            f"| weights | mean reward |\n|---|---|\n| initial | {before:.6f} |\n| trained | {after:.6f} |\n\n"
            f"Before:\n\n{markdown_image(grid_before, 'before')}\n\nAfter:\n\n{markdown_image(grid_after, 'after')}\n\n"
            f"PNGs: `{grid_before}`, `{grid_after}`\n"
        ),
        description="Mean reward and samples before / after fine-tuning",
    )
