"""The flows' results are persisted as JSON that comes back as their pydantic models.

The end-to-end check runs in tests/test_concurrency_and_cancellation.py (sharing its server and served deployment):
a parent flow in another process, whose script imports only prefect (as the example of docs/deployments.md does), triggers run B
with `run_deployment(...)`; `state.result()` gives the `TrainResult` the served run persisted as JSON, read from the
absolute path the run wrote (the parent has its own PREFECT_HOME); a process where OmniFlow cannot be imported (a
machine without it) gets the same fields as a plain dict.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(600)


def test_pipeline_result_round_trips_through_prefects_json_serializer():
    """The pipeline's PipelineResult (with its nested TrainResult) comes back as the model from the JSON the flow
    persists (its end-to-end run is test_pipeline's; this checks the serializer the decorator names)."""
    from omniflow.flows.main_diffusion_v1 import TrainResult, main_diffusion_v1
    from omniflow.flows.pipeline import PipelineResult, diffusion_rl_pipeline
    from prefect.serializers import JSONSerializer

    for flow in (main_diffusion_v1, diffusion_rl_pipeline):
        assert flow.persist_result is True and flow.result_serializer == "json"
    train = TrainResult(
        run_id="r",
        final_checkpoint="/c/global_step_2",
        global_step=2,
        final_metrics={"critic/rewards/mean": 0.25},
        reward_first=0.125,
        reward_last=0.25,
        checkpoint_dir="/c",
        log_dir="/l",
    )
    piped = PipelineResult(
        base_model="models/tiny-sd3",
        train=train,
        reward_before=0.125,
        reward_after=0.25,
        grid_before="before.png",
        grid_after="after.png",
        export_dir="export",
        export_kind="full",
    )
    back = JSONSerializer().loads(JSONSerializer().dumps(piped))
    assert isinstance(back, PipelineResult) and isinstance(back.train, TrainResult) and back == piped
