"""Reward and input faults with real bad files: failing rewards (NaN, raise, a string), a reward that hangs,
non-finite training steps, and prompt / reward files that `validate_config` must reject before Ray starts.

In-process where the fault allows (RewardManager, the trainer's failure rule, the tiny-model TrainingActor);
one flow run for the all-NaN reward, on the session's Ray, TransferQueue and Prefect harness.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from omni_core.rewards.failures import RewardFailureError, check_failure_share
from omni_core.rewards.manager import RewardFailureError as ExportedRewardFailureError
from omni_core.rewards.manager import RewardManager

torch.set_num_threads(1)

FAILING_REWARD = """\
def compute_score(data_source, solution_image, ground_truth, extra_info):
    mode = extra_info.get("mode")
    if mode == "raise":
        raise RuntimeError("reward server said 503")
    if mode == "nan":
        return float("nan")
    if mode == "text":
        return "excellent"
    return float(extra_info["value"])
"""


def reward_cfg(path: Path, timeout_s: float | None = 300.0) -> SimpleNamespace:
    return SimpleNamespace(
        custom_reward_function=SimpleNamespace(path=str(path), name="compute_score"),
        reward_functions=[],
        aggregation="weighted_sum",
        timeout_s=timeout_s,
    )


def write(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(source)
    return path


# ----------------------------------------------------------------------------------------- item 6


def test_failed_rewards_below_the_ratio_get_advantage_zero_and_above_it_fail_the_step(tmp_path):
    """Two groups of four; the trainer's rule as its step runs it: `check_failure_share`, then `step_advantages`
    (advantages over the survivors, 0 for a failed sample) with the run's `algorithm` section."""
    from omni_core.config import load_config
    from omni_core.trainers.base import step_advantages

    manager = RewardManager(reward_cfg(write(tmp_path, "flaky.py", FAILING_REWARD)))
    images = torch.zeros(8, 3, 8, 8, dtype=torch.uint8)
    values = [1.0, 3.0, 0.0, 2.0, 5.0, 5.0, 7.0, 7.0]
    infos = [{"value": v} for v in values]
    infos[2] = {"mode": "nan"}  # one failure in 8: 12.5%
    result = manager.score(images, "x", extra_infos=infos)
    assert result.failed.tolist() == [False, False, True, False, False, False, False, False]
    reasons = [r for r in result.reasons if r]
    assert reasons == ["flaky.compute_score: ValueError: returned non-finite score nan"]

    check_failure_share(1, 8, 0.125, reasons, step=1)  # 12.5% <= 0.125: trains on the other 7
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    dr_grpo = load_config(overrides=["algorithm.norm_adv_by_std_in_grpo=false"]).algorithm
    advantages = step_advantages(dr_grpo, result.scores, result.failed, group)
    # Group 0 without the failed sample: rewards 1, 3, 2 -> mean 2 -> advantages -1, +1, 0; the NaN never
    # reaches the mean (with it the whole group would be NaN). Group 1: 5, 5, 7, 7 -> mean 6 -> -1, -1, +1, +1.
    assert advantages.tolist() == [-1.0, 1.0, 0.0, 0.0, -1.0, -1.0, 1.0, 1.0]
    # The default (flow_grpo, global std): the same deviations over the batch std of the 7 survivors' rewards
    # (1, 3, 2, 5, 5, 7, 7; unbiased, + eps 1e-4); the failed sample stays 0 and out of the std.
    default = step_advantages(load_config().algorithm, result.scores, result.failed, group)
    survivors = torch.tensor([1.0, 3.0, 2.0, 5.0, 5.0, 7.0, 7.0])
    expected = torch.tensor([-1.0, 1.0, 0.0, 0.0, -1.0, -1.0, 1.0, 1.0]) / (survivors.std() + 1e-4)
    torch.testing.assert_close(default, expected)
    assert default[2] == 0.0

    with pytest.raises(RewardFailureError, match=r"step 1: 1 of 8 samples .*reward\.max_failure_ratio=0\.1\b") as err:
        check_failure_share(1, 8, 0.1, reasons, step=1)
    assert "flaky.compute_score: ValueError: returned non-finite score nan" in str(err.value)
    assert "no update was applied" in str(err.value)


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("nan", "flaky.compute_score: ValueError: returned non-finite score nan"),
        ("raise", "flaky.compute_score: RuntimeError: reward server said 503"),
        ("text", "flaky.compute_score: TypeError: returned str 'excellent', expected a number"),
    ],
)
def test_every_sample_failing_fails_the_step_even_at_ratio_one(tmp_path, mode, reason):
    manager = RewardManager(reward_cfg(write(tmp_path, "flaky.py", FAILING_REWARD)))
    result = manager.score(torch.zeros(4, 3, 8, 8, dtype=torch.uint8), "x", extra_infos=[{"mode": mode}] * 4)
    assert result.failed.all() and result.scores.isnan().all()
    group_reason = f"4/4 samples failed: {result.reasons[0]}"  # what the rollout worker tags the prompt with
    assert result.reasons[0] == reason
    with pytest.raises(ExportedRewardFailureError, match="every sample failed, so there is nothing to train on") as err:
        check_failure_share(4, 4, 1.0, [group_reason], step=3)
    assert reason in str(err.value) and isinstance(err.value, RuntimeError)


def test_all_nan_reward_fails_the_flow_run_with_the_reward_and_no_update(
    prefect_api, ray_cluster, transfer_queue, flow_overrides, tmp_path
):
    from omniflow.flows.main_diffusion_v1 import main_diffusion_v1

    reward = write(tmp_path, "nan_reward.py", "def compute_score(*args):\n    return float('nan')\n")
    ckpt = tmp_path / "ckpt"
    overrides = [
        *flow_overrides,
        f"trainer.default_local_dir={ckpt}",
        f"reward.custom_reward_function.path={reward}",
        "trainer.val_before_train=false",
        "trainer.total_epochs=1",
    ]
    state = main_diffusion_v1(overrides=overrides, return_state=True)
    assert state.is_failed()
    message = str(state.message)
    assert "step 1: 8 of 8 samples failed" in message, message
    assert "nan_reward.compute_score: ValueError: returned non-finite score nan" in message, message
    assert "max(): Expected reduction dim" not in message
    assert not (ckpt / "global_step_1").exists()  # no update, no checkpoint


# ----------------------------------------------------------------------------------------- item 7

NONFINITE_SMALL = [
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.pipeline.height=32",
    "actor_rollout_ref.rollout.pipeline.width=32",
    "actor_rollout_ref.rollout.pipeline.num_inference_steps=4",
    "actor_rollout_ref.rollout.algo.sde_window_range=[0,3]",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    # The rollout's log-probs as old log-probs: the recomputed ones would already fail on broken weights.
    "algorithm.rollout_correction.bypass_mode=true",
    "actor_rollout_ref.actor.max_consecutive_nonfinite_steps=2",
]


def test_consecutive_nonfinite_steps_fail_the_run_with_the_metric_and_the_causes(tiny_sd3_dir, one_torch_thread):
    from omni_core.algorithms.update import NonFiniteTrainingError
    from omni_core.config import load_config
    from omni_core.rollout.sampler import generate
    from omni_core.rollout.sampling_params import SamplingParams
    from omni_core.workers.training_actor import TrainingActor

    cfg = load_config(overrides=[*NONFINITE_SMALL, f"actor_rollout_ref.model.path={tiny_sd3_dir}"])
    actor = TrainingActor(cfg.model_dump(mode="json"), total_training_steps=8, num_threads=1, text_encoders=True)
    params = SamplingParams.for_training(cfg.actor_rollout_ref.rollout)
    traj = generate(actor.policy, ["a red circle", "a blue square"], prompt_indices=[0, 1], **params.generate_kwargs(1))
    advantages = torch.linspace(-1, 1, 8)

    def break_weights() -> dict[str, torch.Tensor]:
        weight = next(p for p in actor.policy.transformer.parameters() if p.requires_grad)
        with torch.no_grad():
            weight.fill_(float("inf"))  # every forward is now NaN: loss and gradients are not finite
        return {k: v.clone() for k, v in actor.get_weights().items()}

    broken = break_weights()
    first = actor.train_on(traj, advantages, 1)
    assert math.isnan(first["actor/pg_loss"]) and first["actor/skipped_optimizer_steps"] == 1.0
    assert first["actor/nonfinite_streak"] == 1.0
    assert all(torch.equal(broken[k], v) for k, v in actor.get_weights().items())  # the optimizer step was skipped

    # reset() (a retried epoch) keeps the count; a finite step clears it.
    actor.reset(None)
    assert actor.nonfinite_streak == 1
    fine = actor.train_on(traj, advantages, 1)
    assert math.isfinite(fine["actor/pg_loss"]) and fine["actor/nonfinite_streak"] == 0.0

    break_weights()
    actor.train_on(traj, advantages, 2)
    with pytest.raises(NonFiniteTrainingError) as err:
        actor.train_on(traj, advantages, 3)
    message = str(err.value)
    assert message.startswith("step 3: actor/pg_loss and actor/grad_norm not finite for 2 training steps in a row")
    assert "actor_rollout_ref.actor.max_consecutive_nonfinite_steps=2" in message
    assert "weights are those of step 1" in message
    for key in ("actor_rollout_ref.actor.optim.lr=0.001", "fsdp_config.dtype=float32", "actor_rollout_ref.rollout.dtype="):
        assert key in message, message
    assert actor.get_version() == 2  # the failing step did not move the version


# ----------------------------------------------------------------------------------------- item 8

HANGING_REWARD = """\
import time

def compute_score(data_source, solution_image, ground_truth, extra_info):
    if extra_info.get("hang"):
        time.sleep(3600)
    return 0.5
"""


def test_a_hanging_reward_times_out_its_batch_and_the_manager_stays_usable(tmp_path):
    manager = RewardManager(reward_cfg(write(tmp_path, "slow.py", HANGING_REWARD), timeout_s=0.5))
    images = torch.zeros(3, 3, 8, 8, dtype=torch.uint8)
    start = time.monotonic()
    hung = manager.score(images, "x", extra_infos=[{}, {"hang": True}, {}])
    elapsed = time.monotonic() - start
    assert elapsed < 5.0  # one timeout for the batch, not one per sample (nor an hour)
    assert hung.failed.tolist() == [False, True, True]
    assert hung.scores[0].item() == 0.5
    assert hung.reasons[1] == "slow.compute_score: RewardTimeout: timed out after 0.5 s (reward.timeout_s)"
    # The term is taken to hang: the batch's later samples fail without a call (sample 2 would have scored).
    assert hung.reasons[2] == (
        "slow.compute_score: RewardTimeout: not called: it timed out after 0.5 s (reward.timeout_s) on sample 1 of this batch"
    )
    # The hung call runs on in its abandoned thread; the next batch gets a fresh thread and scores normally.
    again = manager.score(images, "x", extra_infos=[{}, {}, {}])
    assert not again.failed.any() and again.scores.tolist() == [0.5, 0.5, 0.5]
    assert manager._runner.abandoned == 1


def test_a_null_timeout_calls_in_the_callers_thread_and_a_deadline_in_a_worker_thread(tmp_path):
    source = (
        "import threading\ndef compute_score(*a):\n    return float(threading.current_thread().name == 'omniflow-reward-call')\n"
    )
    path = write(tmp_path, "where.py", source)
    image = torch.zeros(1, 3, 8, 8, dtype=torch.uint8)
    assert RewardManager(reward_cfg(path, timeout_s=None)).score(image, "x").scores.item() == 0.0
    assert RewardManager(reward_cfg(path, timeout_s=30)).score(image, "x").scores.item() == 1.0


# ----------------------------------------------------------------------------------------- item 16

CPU_ONLY = {"cuda": 0, "npu": 0, "cpu": 2}


def _problems(tiny_sd3_dir, *overrides: str) -> dict[str, str]:
    from omni_core.config import load_config
    from omni_core.validation import config_problems

    cfg = load_config(overrides=[f"actor_rollout_ref.model.path={tiny_sd3_dir}", *overrides])
    found: dict[str, str] = {}
    for problem in config_problems(cfg, CPU_ONLY):  # several problems of one key: joined
        found[problem.key] = f"{found[problem.key]}\n{problem}" if problem.key in found else str(problem)
    return found


def test_prompt_files_that_would_not_load_are_found_by_validation(tiny_sd3_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from omni_core.data.prompts import PromptFileError, load_prompts

    latin1 = tmp_path / "latin1.txt"
    # \xe9 alone is not UTF-8; it sits at offset 13 ("a red circle\n") + 6 ("un caf") = 19, on line 2.
    latin1.write_bytes("a red circle\nun caf\xe9 rouge\n".encode("latin-1"))
    found = _problems(tiny_sd3_dir, f"data.train_files={latin1}")
    assert list(found) == ["data.train_files"]
    assert f"{latin1}: not UTF-8 text (byte 0xe9 at offset 19, line 2)" in found["data.train_files"]
    with pytest.raises(PromptFileError, match="not UTF-8 text"):  # the loader says the same, not a UnicodeDecodeError
        load_prompts(latin1)

    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"prompt": ["a red circle", "a blue square"], "data_source": ["jpeg_compressibility"] * 2}), good)
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])  # a copy cut short, as an interrupted download
    no_prompt = tmp_path / "no_prompt.parquet"
    pq.write_table(pa.table({"text": ["a red circle"]}), no_prompt)
    bad_json = tmp_path / "rows.jsonl"
    bad_json.write_text('{"prompt": "a red circle"}\n{"prompt": "a blue square"\n')

    assert _problems(tiny_sd3_dir, f"data.train_files={good}", f"data.val_files={good}") == {}
    found = _problems(tiny_sd3_dir, f"data.train_files=[{truncated},{bad_json}]", f"data.val_files={no_prompt}")
    assert f"{truncated}: not a readable parquet file" in found["data.train_files"]
    assert f"{bad_json}: line 2: invalid JSON" in found["data.train_files"]
    assert f"{no_prompt}: no 'prompt' column (columns: text); set data.prompt_key" in found["data.val_files"]


BAD_REWARD_FILES = {
    "syntax.py": (
        "def compute_score(data_source, solution_image:\n    return 1.0\n",
        r"syntax error in reward file .*syntax\.py, line 1",
    ),
    "renamed.py": (
        "def score_image(data_source, solution_image, ground_truth, extra_info):\n    return 1.0\n",
        r"renamed\.py has no function 'compute_score' .*functions defined there: \['score_image'\]",
    ),
    "missing_pkg.py": (
        "import os\nimport not_a_real_reward_pkg_xyz.models\n\ndef compute_score(*a):\n    return 1.0\n",
        r"missing_pkg\.py, line 2: imports 'not_a_real_reward_pkg_xyz\.models', but no package 'not_a_real_reward_pkg_xyz'",
    ),
    "async_fn.py": ("async def compute_score(*a):\n    return 1.0\n", r"'compute_score' in reward file .*async_fn\.py is async"),
}


@pytest.mark.parametrize("name", sorted(BAD_REWARD_FILES))
def test_reward_files_that_would_fail_to_import_are_found_without_running_them(tiny_sd3_dir, tmp_path, name):
    import re

    source, pattern = BAD_REWARD_FILES[name]
    marker = tmp_path / "executed"
    path = write(tmp_path, name, f"open({str(marker)!r}, 'w').close()\n" + source)  # proves the file never ran
    found = _problems(tiny_sd3_dir, f"reward.custom_reward_function.path={path}")
    assert list(found) == ["reward.custom_reward_function.path"], found
    # The line numbers above count from the source; the marker line shifts them by one.
    expected = re.sub(r"line (\d)", lambda m: f"line {int(m.group(1)) + 1}", pattern)
    assert re.search(expected, found["reward.custom_reward_function.path"]), found
    entry = _problems(tiny_sd3_dir, f"reward.reward_functions=[{{path: {path}, function: compute_score}}]")
    assert list(entry) == ["reward.reward_functions[0].path"]
    assert not marker.exists()


def test_omniflow_validate_rejects_bad_files_before_ray_and_stays_light(tiny_sd3_dir, tmp_path):
    import subprocess
    import sys

    latin1 = tmp_path / "prompts.txt"
    latin1.write_bytes("caf\xe9\n".encode("latin-1"))
    reward = write(tmp_path, "broken.py", "def compute_score(:\n")
    code = (
        "import sys; from omniflow.flows.cli import main; rc = main(sys.argv[1:]); "
        "heavy = [m for m in ('ray', 'prefect', 'transfer_queue', 'diffusers', 'torch') if m in sys.modules]; "
        "print('HEAVY', heavy, file=sys.stderr); sys.exit(rc)"
    )
    args = [
        f"actor_rollout_ref.model.path={tiny_sd3_dir}",
        f"data.train_files={latin1}",
        f"reward.custom_reward_function.path={reward}",
    ]
    out = subprocess.run([sys.executable, "-c", code, "validate", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert f"{latin1}: not UTF-8 text" in out.stderr and "syntax error in reward file" in out.stderr
    assert "HEAVY []" in out.stderr
