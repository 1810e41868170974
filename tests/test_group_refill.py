"""`trainer.v1.sampler.drop_incomplete_groups` (issue 13, item 2): a prompt group with a failed sample is evicted and
its prompt sampled again, up to `max_incomplete_group_refill_rounds`; a prompt failing every round is dropped.

Two one-step flow runs of the lean config (session Ray, TransferQueue and Prefect harness) with a real reward file
that fails for one prompt (once, or always) and logs every call, so what was sampled and trained is checked against
the reward's own record; the refusal when the dropped groups break the PPO mini-batches; the config rules.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from real_prefect import run_log_messages

from omni_core.config import ConfigError, load_config
from omni_core.validation import config_problems, prepare_run_config

pytestmark = pytest.mark.timeout(600)

CPU_ONLY = {"cuda": 0, "npu": 0, "cpu": 2}
DROP = "trainer.v1.sampler.drop_incomplete_groups=true"
_ROUNDS = "trainer.v1.sampler.max_incomplete_group_refill_rounds"

# Prompt A fails as `mode` says ("once": its first call only, "always": every call); every call is logged as
# "<tag>\t<score repr or fail>" (one write per line, appended).
REWARD = """\
import os

LOG = {log!r}
MARK = {mark!r}
MODE = {mode!r}


def compute_score(data_source, solution_image, ground_truth, extra_info):
    tag = extra_info["tag"]
    fail = False
    if tag == "A" and MODE == "always":
        fail = True
    elif tag == "A" and MODE == "once":
        try:
            os.close(os.open(MARK, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            fail = True  # this call created the mark: the prompt's first call
        except FileExistsError:
            pass
    score = float(solution_image.float().mean()) / 255.0
    with open(LOG, "a") as f:
        f.write(f"{{tag}}\\t{{'fail' if fail else repr(score)}}\\n")
    if fail:
        raise RuntimeError(f"reward server refused prompt {{tag}}")
    return score
"""


def _reward_run(tmp_path: Path, flow_overrides: list[str], mode: str, extra: list[str]):
    """One step (2 prompts x 4 samples) with drop_incomplete_groups; returns (state, metrics of step 1, reward calls)."""
    from omniflow.flows.main_diffusion_v1 import main_diffusion_v1

    from omni_core.tracking import read_jsonl

    train = tmp_path / "train.jsonl"
    rows = [{"prompt": "a red circle", "extra_info": {"tag": "A"}}, {"prompt": "a blue square", "extra_info": {"tag": "B"}}]
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = tmp_path / "calls.log"
    reward = tmp_path / "refill_reward.py"
    reward.write_text(REWARD.format(log=str(log), mark=str(tmp_path / "failed_once"), mode=mode))
    overrides = [
        *flow_overrides,
        f"data.train_files={train}",
        f"reward.custom_reward_function.path={reward}",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        "trainer.total_epochs=1",
        "trainer.val_before_train=false",
        DROP,
        *extra,
    ]
    state = main_diffusion_v1(overrides=overrides, return_state=True)
    metrics = []
    if state.is_completed():
        metrics = [r for r in read_jsonl(Path(state.result().log_dir) / "metrics.jsonl") if "critic/rewards/mean" in r]
    calls = [line.split("\t") for line in log.read_text().splitlines()]
    return state, metrics, calls


def _scores(calls: list[list[str]], tag: str) -> list[float]:
    return [float(v) for t, v in calls if t == tag and v != "fail"]


def test_a_group_failing_once_is_refilled_and_the_step_trains_a_full_batch(
    prefect_api, ray_cluster, transfer_queue, flow_overrides, tmp_path
):
    state, records, calls = _reward_run(tmp_path, flow_overrides, "once", [])
    assert state.is_completed(), state.message
    assert (tmp_path / "ckpt" / "global_step_1" / "manifest.json").is_file()
    # A's first call failed, so its whole group (4 samples) was evicted and the prompt sampled again (4 more calls);
    # B was sampled once. The same prompt came back, not another one: there is no third prompt to take.
    assert [t for t, _ in calls].count("A") == 8 and [t for t, _ in calls].count("B") == 4
    assert [v for t, v in calls if t == "A"].count("fail") == 1
    [step] = records
    assert step["step"] == 1
    assert step["training/rollout_failure/evicted_groups"] == 1
    assert step["training/rollout_failure/evicted_trajectories"] == 4
    assert step["training/rollout_failure/refilled_prompts"] == 1
    assert step["training/rollout_failure/refill_rounds"] == 1
    assert step["training/rollout_failure/dropped_groups"] == 0
    # A full batch (2 groups x 4) and no failed sample in it.
    assert step["perf/total_num_images"] == 8
    assert step["training/rollout_failure/failed_samples"] == 0 and step["training/rollout_failure/failed_groups"] == 0
    # Trained rewards = B's 4 and the refill's 4 (A's last four calls), never the evicted group's three good ones.
    trained = _scores(calls, "B") + _scores(calls, "A")[-4:]
    assert step["critic/rewards/mean"] == pytest.approx(sum(trained) / 8, rel=1e-5)
    assert step["critic/rewards/min"] == pytest.approx(min(trained), rel=1e-5)
    assert step["critic/rewards/max"] == pytest.approx(max(trained), rel=1e-5)


def test_a_prompt_failing_every_round_is_dropped_and_the_step_trains_the_groups_left(
    prefect_api, ray_cluster, transfer_queue, flow_overrides, tmp_path
):
    # ppo_mini_batch_size=1: one complete group (4 samples, one micro-batch of 4) is a whole mini-batch.
    extra = ["trainer.v1.sampler.max_incomplete_group_refill_rounds=2", "actor_rollout_ref.actor.ppo_mini_batch_size=1"]
    state, records, calls = _reward_run(tmp_path, flow_overrides, "always", extra)
    assert state.is_completed(), state.message
    # The first try plus 2 refills of A, every sample failing; B once.
    assert [v for t, v in calls if t == "A"] == ["fail"] * 12
    assert [t for t, _ in calls].count("B") == 4
    [step] = records
    assert step["training/rollout_failure/evicted_groups"] == 3
    assert step["training/rollout_failure/evicted_trajectories"] == 12
    assert step["training/rollout_failure/refilled_prompts"] == 2
    assert step["training/rollout_failure/refill_rounds"] == 2
    assert step["training/rollout_failure/dropped_groups"] == 1
    assert step["perf/total_num_images"] == 4  # B's group alone
    assert step["training/rollout_failure/failed_samples"] == 0
    assert step["critic/rewards/mean"] == pytest.approx(sum(_scores(calls, "B")) / 4, rel=1e-5)
    assert "actor/pg_loss" in step  # it trained
    # The warning names the prompt, how often it failed and the reward's reason.
    messages = run_log_messages(state.state_details.flow_run_id, "is dropped from this step")
    dropped = [m for m in messages if "is dropped from this step" in m]
    assert dropped, messages[-20:]
    assert "step 1: prompt 000001-" in dropped[0] and "('a red circle') failed 3 times" in dropped[0], dropped[0]
    reason = "4/4 samples failed: refill_reward.compute_score: RuntimeError: reward server refused prompt A (x3)"
    assert dropped[0].endswith(f"reasons: {reason}"), dropped[0]


def test_dropped_groups_that_break_the_mini_batches_fail_the_step_naming_the_keys():
    """`check_trainable`: what is left after a drop must still divide into PPO mini-batches (update._check_sizes)."""
    from omni_core.rollout.group_refill import IncompleteGroupsError, RefilledBatch, check_trainable

    one_left = RefilledBatch(["s-0001"], ["s-0001_0_0", "s-0001_1_0"], dropped={"s-0000": ("boom", "boom again")})
    check_trainable(one_left, group_size=2, ppo_mini_batch_size=1, max_rounds=1, step=3)  # 1 group, mini 1: trains
    with pytest.raises(IncompleteGroupsError) as err:
        check_trainable(one_left, group_size=2, ppo_mini_batch_size=2, max_rounds=1, step=3)
    message = str(err.value)
    for fragment in (
        "step 3: 1 prompt group(s) still failed after trainer.v1.sampler.max_incomplete_group_refill_rounds=1",
        "(s-0000: boom | boom again);",
        "the 1 complete groups left (2 samples) do not divide into PPO mini-batches of "
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "no update was applied",
    ):
        assert fragment in message, message
    nothing_left = RefilledBatch([], [], dropped={"s-0000": ("boom", "boom")})
    with pytest.raises(IncompleteGroupsError, match=r"\(s-0000: boom \(x2\)\); no complete group is left"):
        check_trainable(nothing_left, group_size=2, ppo_mini_batch_size=1, max_rounds=1, step=3)


# ------------------------------------------------------------------------------------------------ config rules
def test_drop_incomplete_groups_in_separate_async_is_refused_by_omniflow_validate(tiny_sd3_dir):
    """Before anything starts: `omniflow validate` (no Ray, no TransferQueue) exits non-zero naming the key."""
    args = [
        f"actor_rollout_ref.model.path={tiny_sd3_dir}",
        "trainer.v1.trainer_mode=separate_async",
        "actor_rollout_ref.rollout.nnodes=1",
        "algorithm.rollout_correction.bypass_mode=true",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        DROP,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "omniflow.flows.cli", "validate", *args], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "trainer.v1.sampler.drop_incomplete_groups=true: only trainer.v1.trainer_mode=sync supports it" in text, text
    with pytest.raises(ConfigError) as err:  # the flow's validate_config task runs the same rules
        prepare_run_config(None, args)
    assert err.value.keys == ["trainer.v1.sampler.drop_incomplete_groups"], str(err.value)


@pytest.mark.parametrize("rounds", ["0", "-1", "1.5", "many"])
def test_a_bad_refill_rounds_value_is_refused(rounds, tiny_sd3_dir):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[f"actor_rollout_ref.model.path={tiny_sd3_dir}", DROP, f"{_ROUNDS}={rounds}"])
    assert err.value.keys == [_ROUNDS], str(err.value)


def test_refill_keys_that_would_do_nothing_or_conflict_are_refused_naming_both_keys(tiny_sd3_dir):
    model = f"actor_rollout_ref.model.path={tiny_sd3_dir}"

    def problems(*overrides: str) -> dict[str, str]:
        return {p.key: str(p) for p in config_problems(load_config(overrides=[model, *overrides]), CPU_ONLY)}

    assert problems(DROP) == {}  # sync mode, gen_batch_size null: accepted
    assert problems(DROP, "data.gen_batch_size=1", f"{_ROUNDS}=5") == {}
    found = problems(DROP, "data.gen_batch_size=2", "reward.max_failure_ratio=0.5")
    assert set(found) == {"data.gen_batch_size", "reward.max_failure_ratio"}
    assert (
        "data.gen_batch_size=2: trainer.v1.sampler.drop_incomplete_groups=true generates one prompt"
        in found["data.gen_batch_size"]
    )
    assert "drop_incomplete_groups=true no failed sample is trained" in found["reward.max_failure_ratio"]
    found = problems(f"{_ROUNDS}=5")  # rounds without the refill
    assert set(found) == {_ROUNDS} and "only trainer.v1.sampler.drop_incomplete_groups=true" in found[_ROUNDS]
