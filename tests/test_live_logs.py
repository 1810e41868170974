"""Logs and artifacts of a run as a person watches it in the UI.

- A real run (the session's Ray cluster, TransferQueue and Prefect API; 2 steps in one epoch): the controller's
  line of step 1 and a line an actor logged through an `omni_core` logger (the reward manager's warning about a
  failed sample of step 1, logged inside the training actor) are in the API while `fit_epoch-0` is still running; the run
  links the Ray dashboard and emits its checkpoint and validation events.
- Image artifacts: a PNG up to `MAX_EMBEDDED_PNG_BYTES` is embedded, a larger one is linked, never stored as base64.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from real_prefect import api

pytestmark = pytest.mark.timeout(600)

ACTOR_LINE = "omni_core.rewards.manager: reward failed for sample"
STEP_1_LINE = "step 1/2"
# The reward scores the validation before training (1 prompt x 1 sample: call 1), then step 1's 8 samples (calls 2-9)
# and step 2's. It fails for step 1's first sample (call 2), and only that one. Step 2's samples (calls 10 on) wait until the test has looked for
# the lines it wants (the file GO exists; at most 120 s), so the epoch cannot end before they were looked for: no race
# with the speed of the machine. Lines that reached the API only at the end of the epoch are seen with fit_epoch-0 done.
REWARD = """
import os
import time

import numpy as np

_calls = []


def compute_score(data_source, solution_image, ground_truth=None, extra_info=None):
    _calls.append(1)
    if len(_calls) == 2:
        raise RuntimeError("live-logs test: the first sample fails")
    deadline = time.monotonic() + 120
    while len(_calls) > 9 and not os.path.exists(GO) and time.monotonic() < deadline:
        time.sleep(0.2)
    return float(np.asarray(solution_image, dtype=np.float32).mean() / 255.0)
"""


class Watcher(threading.Thread):
    """Polls the API while the run runs: each wanted line's first sighting, with the state of `fit_epoch-0` read
    just after it (so RUNNING means the line was visible before the epoch ended)."""

    def __init__(self, url: str, since: datetime, wanted: tuple[str, ...], go: Path):
        super().__init__(daemon=True)
        self.url, self.since, self.wanted, self.go = url, since, wanted, go
        self.seen: dict[str, str] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        from prefect.client.schemas.filters import (
            LogFilter,
            LogFilterTaskRunId,
            TaskRunFilter,
            TaskRunFilterName,
            TaskRunFilterStartTime,
        )

        with api(self.url) as client:
            while not self.stop.wait(0.5) and len(self.seen) < len(self.wanted):
                runs = client.read_task_runs(
                    task_run_filter=TaskRunFilter(
                        name=TaskRunFilterName(any_=["fit_epoch-0"]), start_time=TaskRunFilterStartTime(after_=self.since)
                    )
                )
                if not runs:
                    continue
                task_run_id = runs[0].id
                logs = client.read_logs(log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run_id])))
                state = client.read_task_run(task_run_id).state.type.value
                for line in self.wanted:
                    if line not in self.seen and any(line in log.message for log in logs):
                        self.seen[line] = state
        self.go.touch()  # step 2 may finish now


def _events(name: str, since: datetime) -> list[dict[str, Any]]:
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter

    # Only this test's time: the session's API holds every checkpoint event of the suite's runs before it.
    event_filter = EventFilter(event=EventNameFilter(name=[name]), occurred=EventOccurredFilter(since=since))
    body = {"filter": event_filter.model_dump(mode="json"), "limit": 50}
    with get_client(sync_client=True) as client:
        return client.request("POST", "/events/filter", json=body).json()["events"]


def test_run_logs_arrive_while_the_epoch_runs(prefect_api, ray_cluster, transfer_queue, flow_overrides, tmp_path):
    from omniflow.flows.main_diffusion_v1 import main_diffusion_v1
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    from omni_core.distributed.ray_cluster import dashboard_url

    (tmp_path / "train.txt").write_text("a red circle\na blue square\na green dot\na yellow star\n")  # 2 steps of 2
    reward = tmp_path / "first_fails.py"
    go = tmp_path / "GO"
    reward.write_text(f"GO = {str(go)!r}\n{REWARD}")
    since = datetime.now(UTC)
    watcher = Watcher(prefect_api, since, (STEP_1_LINE, ACTOR_LINE), go)
    watcher.start()
    try:
        state = main_diffusion_v1(
            overrides=[
                *flow_overrides,
                f"data.train_files={tmp_path / 'train.txt'}",
                "trainer.total_epochs=1",
                f"trainer.default_local_dir={tmp_path / 'ckpt'}",
                f"reward.custom_reward_function.path={reward}",
                "reward.max_failure_ratio=0.5",
            ],
            return_state=True,
        )
    finally:
        watcher.stop.set()
        watcher.join(timeout=30)
    assert state.is_completed(), state.message
    result = state.result()
    assert result.global_step == 2
    assert watcher.seen == {STEP_1_LINE: "RUNNING", ACTOR_LINE: "RUNNING"}, watcher.seen

    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        (link,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=["omniflow-ray-dashboard"]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])
            )
        )
    assert link.type == "markdown" and dashboard_url() in link.data  # a link artifact is markdown "[text](url)"

    def of_run(name: str) -> list[dict[str, Any]]:
        return [e for e in _events(name, since) if e["resource"].get("omniflow.run-id") == result.run_id]

    deadline = time.monotonic() + 120  # the API persists events in batches (later on a busy machine)
    while time.monotonic() < deadline and not (of_run("omniflow.checkpoint.saved") and of_run("omniflow.validation.completed")):
        time.sleep(0.5)
    (saved,) = of_run("omniflow.checkpoint.saved")
    assert saved["payload"]["path"] == result.final_checkpoint and saved["payload"]["step"] == 2
    related = {r["prefect.resource.id"] for r in saved["related"]}
    assert {f"prefect.flow-run.{flow_run_id}", f"omniflow.checkpoint.{result.final_checkpoint}"} <= related
    (validated,) = of_run("omniflow.validation.completed")  # val_before_train
    assert validated["payload"]["step"] == 0 and isinstance(validated["payload"]["reward"], float)


def test_images_over_the_cap_are_linked_and_smaller_ones_embedded(tmp_path):
    from omni_core.records import EpochResult
    from omni_core.reports import MAX_EMBEDDED_PNG_BYTES, markdown_image, save_image_grid
    from omni_core.reports.cards import validation_cards

    small = save_image_grid(torch.zeros(4, 3, 32, 32, dtype=torch.uint8), tmp_path / "small.png")
    noise = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (4, 3, 256, 256), dtype=np.uint8))
    large = save_image_grid(noise, tmp_path / "large.png")  # random pixels do not compress: ~790 kB
    assert small.stat().st_size <= MAX_EMBEDDED_PNG_BYTES < large.stat().st_size

    assert markdown_image(small, "grid").startswith("![grid](data:image/png;base64,")
    linked = markdown_image(large, "grid")
    assert linked.startswith(f"[grid]({large.resolve().as_uri()})") and "base64" not in linked
    assert str(large.resolve()) in linked
    # The same file either side of the cap, given explicitly.
    size = large.stat().st_size
    assert markdown_image(large, "grid", max_bytes=size).startswith("![grid](data:")
    assert markdown_image(large, "grid", max_bytes=size - 1).startswith("[grid](file://")

    result = EpochResult(epoch=0, global_step=1, checkpoint=None, val_grids=[(1, str(large), {"val-core/x/reward/mean@4": 0.5})])
    (card,) = validation_cards(result)
    assert "data:image" not in card.markdown and large.resolve().as_uri() in card.markdown
