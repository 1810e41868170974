"""`trainer.v1.trainer_mode=separate_async` through the flow: a standalone rollout pool sampling one batch ahead.

The lean config with one prompt per step (2 steps per epoch, 2 epochs), one warm-up batch, weights published
every step and a threshold of 2 (verl's span: a group is trained at most 2 global steps after its prompt was
submitted, counting the training step): the rollout of step k+1 runs while step k trains, with the
weights of step k-1, across epoch ends too (a checkpoint records the queued groups and the next epoch puts them
back), so the staleness of the steps' trajectories is exactly 0, 1, 1, 1 (read from each trajectory's
`model_version` tag by the replay buffer, and checked here against that schedule). With one rollout worker the groups are trained in the order they were
put and each request names its weights, so the run is deterministic: a second run whose worker is killed
mid-run ends with the same weights, bit for bit. (With several workers the replay buffer trains the oldest
groups that are ready, and which are ready first depends on timing: such runs are not bit-reproducible.)
"""

from __future__ import annotations

import pytest
from flow_utils import assert_same_weights, final_weights

pytestmark = pytest.mark.timeout(600)

ASYNC = [
    "trainer.v1.trainer_mode=separate_async",
    "actor_rollout_ref.rollout.nnodes=1",
    "trainer.v1.separate_async.num_warmup_batches=1",
    "trainer.v1.separate_async.parameter_sync_step=1",
    "trainer.v1.sampler.max_off_policy_threshold=2",
    "algorithm.rollout_correction.bypass_mode=true",
    "data.train_batch_size=1",
    "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    "trainer.save_freq=1",  # a checkpoint inside each epoch too, while the next step's batch is queued
]


@pytest.fixture(scope="module")
def async_runs(flow_overrides, prefect_api, ray_cluster, transfer_queue, tmp_path_factory):
    """{"clean": ..., "killed": ...}: (final state, checkpoint dir, killed pids) of the same config with one
    standalone rollout worker, run twice.

    "killed": `omniflow train` in its own process, SIGKILLed with every process it started once step 1's
    checkpoint is committed (it holds step 2's group, sampled ahead), then resumed (resume_mode=auto) here; the
    resumed run loses its rollout worker (SIGKILL, pid from Ray's state API) once step 2 is saved, so epoch 2 is
    retried from that checkpoint on the worker Ray restarted."""
    import threading

    from flow_utils import kill_when
    from omniflow.flows.main_diffusion_v1 import main_diffusion_v1
    from test_cli_runs import _env, _freeze_and_kill, _latest, _train, _wait_for

    runs = {}
    for name in ("clean", "killed"):
        ckpt = tmp_path_factory.mktemp(f"async-{name}") / "ckpt"
        overrides = [*flow_overrides, *ASYNC, f"trainer.default_local_dir={ckpt}", f"trainer.experiment_name=async-{name}"]
        killed: list[int] = []
        if name == "killed":
            log = ckpt.parent / "first.log"
            first = _train(overrides, _env(PREFECT_API_URL=prefect_api), log)
            _wait_for(lambda ckpt=ckpt: _latest(ckpt) == "1", first, 600, log, poll_s=0.05)
            _freeze_and_kill(first.pid)
            first.wait(timeout=60)
            assert _latest(ckpt) == "1" and not (ckpt / "global_step_2").exists(), "the kill landed after step 2 was saved"
            args = (ckpt, "async-killed-", "RolloutWorker", killed)
            watcher = threading.Thread(target=kill_when, args=args, kwargs={"after_step": 2}, daemon=True)
            watcher.start()
        state = main_diffusion_v1(overrides=overrides, return_state=True)
        assert state.is_completed(), state.message
        if name == "killed":
            watcher.join(timeout=60)
        runs[name] = (state, ckpt, killed)
    return runs


def _step_records(ckpt, run_id: str | None = None) -> list[dict]:
    """The step records of the run's metrics log (the only run in `ckpt`, or the run `run_id`)."""
    from omni_core.tracking import read_jsonl

    dirs = [d for d in (ckpt / "logs").iterdir() if run_id is None or d.name == run_id]
    (log_dir,) = dirs
    return [r for r in read_jsonl(log_dir / "metrics.jsonl") if "critic/rewards/mean" in r]


def test_an_async_run_trains_each_step_at_the_staleness_its_schedule_gives(async_runs):
    state, ckpt, _ = async_runs["clean"]
    assert state.result().global_step == 4
    records = _step_records(ckpt)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    key = "training/off_policy/trajectory_staleness"
    # Step 1 samples with the base weights; every later batch was put one step ahead, epoch ends included.
    assert [r[f"{key}/max"] for r in records] == [0.0, 1.0, 1.0, 1.0]
    assert [r[f"{key}/min"] for r in records] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["training/off_policy/evicted_samples"] == 0.0 for r in records)
    assert all(r[f"{key}_worst/max"] <= 1.0 for r in records)
    for r in records:  # measured shares of the step: the trainer waiting, the rollout pool not sampling
        assert 0.0 <= r["perf/idle_share/training"] <= 1.0 and 0.0 <= r["perf/idle_share/rollout"] <= 1.0
    # Bypass: the first ratio of an on-policy step is exactly 1; a stale step's is the importance weight.
    assert records[0]["actor/ratio_mean"] == 1.0 and records[1]["actor/ratio_mean"] != 1.0


def test_a_checkpoint_records_the_groups_sampled_ahead(async_runs):
    """Each checkpoint waits for the queued request (step k+1's group, sampled with the weights of step k-1),
    records it with the feeding state, and saves the loader past it: step 2's (the end of epoch 1) and step 3's
    (inside epoch 2) hold one group each, the last one none."""
    import torch

    from omni_core.checkpoint import read_state

    _, ckpt, _ = async_runs["clean"]
    for step, (epoch, position), groups in [(2, (1, 1), 1), (3, (2, 0), 1), (4, (2, 0), 0)]:
        folder = ckpt / f"global_step_{step}"
        loader, feed = read_state(folder, "dataloader"), read_state(folder, "rollout_queue")
        assert (loader["epoch"], loader["position"]) == (epoch, position), (step, loader)
        assert feed == {"next_feed": min(step + 2, 5), "weights_version": step, "refills": 0, "groups": groups}, (step, feed)
        assert not (folder / "rollout_weights.safetensors").exists()  # weights published every step: the checkpoint's own
        record = torch.load(folder / "rollout_queue.pt", weights_only=True)
        assert len(record["prompts"]) == groups
        for uid, tag in record["prompts"].items():
            # Step k+1's group (uid 00000<k+1>-...), submitted at step k (verl's `global_steps` tag) with version k - 1.
            assert uid.startswith(f"{step + 1:06d}-"), uid
            assert (tag["status"], tag["global_steps"], tag["model_version"]) == ("finished", step, step - 1), (uid, tag)
        assert {t["model_version"] for t in record["trajectory_tags"].values()} == ({step - 1} if groups else set())
        assert len(record["trajectory_tags"]) == 4 * groups  # rollout.n samples of the group


def test_the_schedule_is_deterministic_through_a_sigkill_and_a_killed_rollout_worker(async_runs):
    """The killed run ends bit-identical to the clean one: its resume put back the group step 1's checkpoint had
    sampled ahead (step 2 trains it, 1 version stale, as in the clean run) and fed on from the loader position
    past it; its retried epoch did the same from step 2's checkpoint. No prompt was trained twice or skipped:
    each step trained once, at the clean run's staleness, and each request names the weights it samples with."""
    import ray
    from ray.util.state import list_actors

    state, ckpt, killed = async_runs["killed"]
    assert killed, "the rollout worker was not found to kill"
    assert_same_weights(final_weights(ckpt), final_weights(async_runs["clean"][1]))
    resumed = [r for r in _step_records(ckpt, run_id=state.result().run_id)]
    assert [r["step"] for r in resumed] == [2, 3, 4]  # step 1 came from the killed process's checkpoint
    assert [r["training/off_policy/trajectory_staleness/max"] for r in resumed] == [1.0, 1.0, 1.0]
    (worker,) = list_actors(
        address=ray.get_runtime_context().gcs_address,
        filters=[("name", "=", f"omniflow-{state.result().run_id}-rollout-worker-0")],
        detail=True,
    )
    assert worker.num_restarts == 1, worker


SLOW_REWARD = """
import json
import time
from pathlib import Path

LOG_DIR = Path({log_dir!r})
HOLD_UNTIL_STEP = {hold_until_step}
HOLD_AT_MOST_S = {hold_at_most_s}
_held_since = []  # when the first sample of the slow group was scored


def _steps_logged():
    count = 0
    for log in LOG_DIR.glob("*/metrics.jsonl"):
        count += sum(1 for line in log.read_text().splitlines() if '"critic/rewards/mean"' in line)
    return count


def compute_score(data_source, solution_image, ground_truth=None, extra_info=None):
    if ground_truth == "slow":  # held until the trainer has logged HOLD_UNTIL_STEP steps, HOLD_AT_MOST_S at most
        _held_since[:] = _held_since or [time.monotonic()]
        deadline = _held_since[0] + HOLD_AT_MOST_S
        while _steps_logged() < HOLD_UNTIL_STEP and time.monotonic() < deadline:
            time.sleep(0.05)
    return float(solution_image.float().mean() / 255) if hasattr(solution_image, "float") else 0.5
"""


@pytest.mark.parametrize("strategy", ["drop", "wait"])
def test_a_slow_prompt_group_is_dropped_or_waited_for(
    strategy, flow_overrides, tmp_path, prefect_api, ray_cluster, transfer_queue
):
    """Two rollout workers, 4 prompts with one batch each, threshold 2 (verl's span), weights published every step.
    The slow prompt ("a green dot", put at step 2 with version 1) has a custom reward that holds its group until the
    trainer has logged step 3, so what happens does not depend on timing:
    `drop`: step 3 trains the fast prompt put after it, so the slow group is first seen finished at step 4, at span
    4 - 2 + 1 = 3: it is evicted and counted (one group, verl's `evicted_samples`) and one more prompt batch is put
    and trained.
    `wait`: at step 3 the slow group is in flight at span 3 - 2 + 1 = 2, the threshold, so sampling holds for it
    (its reward lets go after 10 s, as step 3 never comes) and step 3 trains it, 1 version stale, instead of the
    fast prompt that is ready. Either way no trained group is over the threshold."""
    import json

    from omniflow.flows.main_diffusion_v1 import main_diffusion_v1

    prompts = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": p, "reward_model": {"ground_truth": gt}}
        for p, gt in [("a red circle", "fast"), ("a blue square", "fast"), ("a green dot", "slow"), ("a pink star", "fast")]
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ckpt = tmp_path / "ckpt"
    reward = tmp_path / "slow_reward.py"
    reward.write_text(
        SLOW_REWARD.format(log_dir=str(ckpt / "logs"), hold_until_step=3, hold_at_most_s=300 if strategy == "drop" else 10)
    )
    overrides = [
        *flow_overrides,
        *[o for o in ASYNC if not o.startswith("trainer.save_freq")],
        "actor_rollout_ref.rollout.n_gpus_per_node=2",
        f"data.train_files={prompts}",
        "data.shuffle=false",
        f"reward.custom_reward_function.path={reward}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.total_epochs=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        f"trainer.v1.sampler.max_off_policy_strategy={strategy}",
        f"trainer.default_local_dir={ckpt}",
        f"trainer.experiment_name=slow-{strategy}",
    ]
    state = main_diffusion_v1(overrides=overrides, return_state=True)
    assert state.is_completed(), state.message
    records = _step_records(ckpt)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["training/off_policy/trajectory_staleness/max"] <= 1.0 for r in records), records
    evicted = [r["training/off_policy/evicted_samples"] for r in records]
    if strategy == "drop":
        assert evicted == [0.0, 0.0, 0.0, 1.0], evicted  # the slow group, once, at step 4
        assert records[3]["training/off_policy/evicted_samples_staleness/max"] == 3.0, records[3]
    else:
        assert sum(evicted) == 0.0, evicted
        assert max(r["training/off_policy/trajectory_staleness_worst/max"] for r in records) <= 1.0
        # step 3 waited for the slow group (version 1) rather than train the fast one put at step 3 (version 2)
        assert records[2]["training/off_policy/trajectory_staleness/max"] == 1.0, records[2]


def test_a_step_runs_parameter_sync_step_local_updates_as_verl_omni(
    flow_overrides, tmp_path, prefect_api, ray_cluster, transfer_queue
):
    """verl-omni's separate_async step: `parameter_sync_step` local updates, each on `train_batch_size /
    parameter_sync_step` prompt groups with its own advantages and optimizer step, and a learning-rate schedule over
    `total_training_steps x parameter_sync_step` updates. Two prompts per step, two local updates of one group each, two
    global steps (4 updates): the cosine schedule's multiplier after u updates is 0.5 (1 + cos(pi u / 4)), and a step's
    `actor/lr` is its last update's, after 1 and 3 updates (one update per step would log the multipliers after 0 and 1
    of 2: 1 and 0.5)."""
    import math

    from omniflow.flows.main_diffusion_v1 import main_diffusion_v1

    from omni_core.config import load_config

    ckpt = tmp_path / "ckpt"
    overrides = [
        *flow_overrides,
        *[o for o in ASYNC if not o.startswith(("data.train_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size"))],
        "trainer.v1.separate_async.parameter_sync_step=2",
        "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        f"trainer.default_local_dir={ckpt}",
    ]
    lr = load_config(overrides=overrides).actor_rollout_ref.actor.optim.lr
    state = main_diffusion_v1(overrides=overrides, return_state=True)
    assert state.is_completed(), state.message
    records = _step_records(ckpt)
    assert [r["step"] for r in records] == [1, 2]
    expected = [lr * 0.5 * (1 + math.cos(math.pi * u / 4)) for u in (1, 3)]
    assert [r["actor/lr"] for r in records] == pytest.approx(expected, rel=1e-6)
    # Both steps' batches were sampled with the base weights (published after every 2nd step): step 2's groups are
    # one version stale.
    assert [r["training/off_policy/trajectory_staleness/max"] for r in records] == [0.0, 1.0]
