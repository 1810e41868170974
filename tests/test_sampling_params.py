"""`SamplingParams` and `RolloutRequest`: the trainer decides how a request samples, once, from the config."""

from __future__ import annotations

import pytest

from omni_core.config import load_config
from omni_core.data.prompts import PromptRecord
from omni_core.rollout.request import RolloutRequest
from omni_core.rollout.sampling_params import SamplingParams

OVERRIDES = [
    "actor_rollout_ref.rollout.n=6",
    "actor_rollout_ref.rollout.seed=11",
    "actor_rollout_ref.rollout.pipeline.height=48",
    "actor_rollout_ref.rollout.pipeline.width=32",
    "actor_rollout_ref.rollout.pipeline.num_inference_steps=8",
    "actor_rollout_ref.rollout.pipeline.guidance_scale=4.5",
    "actor_rollout_ref.rollout.pipeline.max_sequence_length=77",
    "actor_rollout_ref.rollout.algo.noise_level=0.9",
    "actor_rollout_ref.rollout.algo.sde_type=cps",
    "actor_rollout_ref.rollout.algo.sde_window_size=3",
    "actor_rollout_ref.rollout.algo.sde_window_range=[1,6]",
    "actor_rollout_ref.rollout.val_kwargs.n=2",
    "actor_rollout_ref.rollout.val_kwargs.seed=99",
    "actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps=5",
    "actor_rollout_ref.rollout.val_kwargs.algo.noise_level=0.0",
]


@pytest.fixture(scope="module")
def rollout():
    return load_config(overrides=OVERRIDES).actor_rollout_ref.rollout


def test_training_params_are_the_rollout_keys(rollout):
    params = SamplingParams.for_training(rollout)
    assert params.generate_kwargs(global_step=7) == {
        "n": 6,
        "seed": 11,
        "height": 48,
        "width": 32,
        "num_inference_steps": 8,
        "guidance_scale": 4.5,
        "true_cfg_scale": 1.0,
        "noise_level": 0.9,
        "sde_type": "cps",
        "sde_window_size": 3,
        "sde_window_range": (1, 6),
        "max_sequence_length": 77,
        "calculate_log_probs": True,
        "init_same_noise": False,  # null under sde_type=cps: each sample's own noise
        "global_step": 7,  # training reseeds every step
    }


def test_validation_params_take_val_kwargs_and_fixed_noise(rollout):
    params = SamplingParams.for_validation(rollout)
    kwargs = params.generate_kwargs(global_step=7)
    assert (kwargs["n"], kwargs["seed"], kwargs["num_inference_steps"], kwargs["noise_level"]) == (2, 99, 5, 0.0)
    assert kwargs["calculate_log_probs"] is False
    assert kwargs["global_step"] == 0  # the same noise at every evaluation, so images compare across steps
    # Everything val_kwargs does not set is the training value.
    assert (kwargs["height"], kwargs["width"], kwargs["guidance_scale"], kwargs["sde_type"]) == (48, 32, 4.5, "cps")


def test_negative_prompts_only_with_cfg(rollout):
    params = SamplingParams.for_training(rollout)
    assert params.negative_prompts(["blurry", None]) == ["blurry", ""]
    assert params.replace(guidance_scale=1.0).negative_prompts(["blurry", None]) is None
    # FLUX / Qwen-Image: true_cfg_scale is CFG (which scale is CFG is the architecture's, in the sampler)
    assert params.replace(guidance_scale=1.0, true_cfg_scale=2.0).negative_prompts(["blurry", None]) == ["blurry", ""]


def test_a_request_has_deterministic_uids_and_splits_contiguously(rollout):
    records = [PromptRecord(prompt=f"p{i}", index=10 + i) for i in range(5)]
    request = RolloutRequest.of_records("run/train", 3, SamplingParams.for_training(rollout), records, uid_prefix="000003")
    assert request.uids == ["000003-0000", "000003-0001", "000003-0002", "000003-0003", "000003-0004"]
    assert request.num_samples == 5 * 6
    parts = request.split(2)
    # positions (which seed the samples) travel with the items, whatever worker gets them
    assert [[it.position for it in p.items] for p in parts] == [[0, 1], [2, 3, 4]]
    assert [[it.record.index for it in p.items] for p in parts] == [[10, 11], [12, 13, 14]]
    assert all(p.params is request.params and p.global_step == 3 and p.partition == "run/train" for p in parts)
    # boundaries floor(5 * i / 7) for i = 0..7: 0, 0, 1, 2, 2, 3, 4, 5
    assert [len(p.items) for p in request.split(7)] == [0, 1, 1, 0, 1, 1, 1]
