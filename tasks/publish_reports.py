"""Artifacts a person looks at to judge a run: validation image grids, the reward curve (redrawn per
epoch) and the run summary on the main run's page. Pictures are embedded as data URIs, so the
Prefect UI shows them without a file server; the PNG files stay on disk next to the checkpoints."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from omni_core.records import EpochResult, RunInfo
from omni_core.reports import png_data_uri, save_reward_curve, trend_line

REWARD_CURVE = "reward_curve.png"


def _metrics_lines(metrics: dict[str, float]) -> str:
    return "\n".join(f"| {k} | {v:.6f} |" for k, v in sorted(metrics.items()))


def publish_validation_grids(result: EpochResult) -> None:
    """One `omniflow-validation` artifact per validation of the epoch (call inside a task)."""
    for step, path, metrics in result.val_grids:
        reward = _val_reward(metrics)
        create_markdown_artifact(
            key="omniflow-validation",
            markdown=(
                f"### Validation samples at step {step}\n\nRows: prompts; columns: samples (noise 0, fixed seeds).\n\n"
                f"![validation samples, step {step}]({png_data_uri(path)})\n\n| metric | value |\n|---|---|\n"
                f"{_metrics_lines(metrics)}\n\nPNG: `{path}`\n"
            ),
            # The description is what the run page's artifact card shows: put the reward there too.
            description=f"Validation at step {step}" + (f": reward {reward:.6f}" if reward is not None else ""),
        )


def _all_steps(epochs: list[EpochResult]) -> list[dict[str, float]]:
    return [m for e in epochs for m in e.step_metrics]


def _val_reward(metrics: dict[str, float]) -> float | None:
    """The mean of a validation's `val-core/<data source>/reward/mean@n` values (None if it has none)."""
    rewards = [v for k, v in metrics.items() if k.startswith("val-core/")]
    return sum(rewards) / len(rewards) if rewards else None


def _val_points(epochs: list[EpochResult]) -> list[tuple[int, float]]:
    points = [(step, _val_reward(metrics)) for e in epochs for step, _, metrics in e.val_grids]
    return [(step, r) for step, r in points if r is not None]


@task(name="publish_reward_curve", cache_policy=NO_CACHE)
def publish_reward_curve(run: RunInfo, epochs: list[EpochResult], total_epochs: int) -> str:
    """Redraw `<log_dir>/reward_curve.png` from every epoch so far; artifact `omniflow-reward-curve`."""
    steps = _all_steps(epochs)
    path = save_reward_curve(steps, Path(run.log_dir) / REWARD_CURVE, _val_points(epochs), title=run.run_id)
    line = trend_line([m["critic/rewards/mean"] for m in steps if "critic/rewards/mean" in m])
    done = epochs[-1].epoch + 1 if epochs else 0
    create_markdown_artifact(
        key="omniflow-reward-curve",
        markdown=f"### Reward curve after epoch {done}/{total_epochs}: {line}\n\n![reward curve]({png_data_uri(path)})\n\nPNG: `{path}`\n",
        description=line,
    )
    return str(path)


def publish_run_summary(run: RunInfo, epochs: list[EpochResult], final_checkpoint: str | None, global_step: int) -> None:
    """The main run's own artifact `omniflow-run-summary`: trend, reward curve, last validation grid.

    Called in the flow itself, not as a task: a task whose input is a subflow's return value gets a
    `flow_run` task input, which the Prefect 3.9.1 UI cannot parse ("Invalid TaskInputResponse"), and
    the run's Task Runs tab and log task names then stay empty.
    """
    steps = _all_steps(epochs)
    line = trend_line([m["critic/rewards/mean"] for m in steps if "critic/rewards/mean" in m])
    parts = [f"### {run.run_id}: {line}\n", f"Steps trained: {global_step}; last checkpoint: `{final_checkpoint}`\n"]
    curve = Path(run.log_dir) / REWARD_CURVE
    if steps:
        save_reward_curve(steps, curve, _val_points(epochs), title=run.run_id)
        parts.append(f"![reward curve]({png_data_uri(curve)})\n")
    grids = [g for e in epochs for g in e.val_grids]
    if grids:
        step, path, _ = grids[-1]
        parts.append(f"Last validation samples (step {step}):\n\n![validation samples]({png_data_uri(path)})\n")
    create_markdown_artifact(key="omniflow-run-summary", markdown="\n".join(parts), description=line)
