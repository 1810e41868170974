"""Artifacts a person looks at to judge a run: validation image grids, the reward curve (redrawn per
epoch) and the run summary on the main run's page. The cards themselves are built in
`omni_core.reports.cards`; this module publishes them."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from omni_core.records import EpochResult, RunInfo
from omni_core.reports.cards import Card, reward_curve_card, run_summary_card, validation_cards
from omni_core.reports.plots import load_plotting

# The flow process draws the reward curve after every epoch. Its plotting library is loaded now, with the
# flow, not at the end of the first epoch: a Ctrl-C / SIGTERM that lands inside matplotlib's first import
# turns into "ImportError: initialization failed" and a failed run instead of a clean interruption.
load_plotting()


def publish_card(key: str, card: Card) -> None:
    create_markdown_artifact(key=key, markdown=card.markdown, description=card.description)


def publish_validation_grids(result: EpochResult) -> None:
    """One `omniflow-validation` artifact per validation of the epoch (call inside a task)."""
    for card in validation_cards(result):
        publish_card("omniflow-validation", card)


@task(name="publish_reward_curve", cache_policy=NO_CACHE)
def publish_reward_curve(run: RunInfo, epochs: list[EpochResult], end_epoch: int) -> None:
    """Redraw `<log_dir>/reward_curve.png` from every epoch so far; artifact `omniflow-reward-curve`."""
    publish_card("omniflow-reward-curve", reward_curve_card(run, epochs, end_epoch))


def publish_run_summary(
    run: RunInfo, epochs: list[EpochResult], final_checkpoint: str | None, global_step: int, note: str | None = None
) -> None:
    """The main run's own artifact `omniflow-run-summary`: trend, reward curve, last validation grid.

    Called in the flow itself, not as a task: a task whose input is a subflow's return value gets a
    `flow_run` task input, which the Prefect 3.9.1 UI cannot parse ("Invalid TaskInputResponse"), and
    the run's Task Runs tab and log task names then stay empty.
    """
    publish_card("omniflow-run-summary", run_summary_card(run, epochs, final_checkpoint, global_step, note))
