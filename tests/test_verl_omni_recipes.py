"""verl-omni's recipes, carried over unchanged, through `omniflow validate`: the flowgrpo v1 recipes (SD3.5) and the
GRPO-Guard, Flow-DPPO, MixGRPO, rollout-correction and DiffusionNFT recipes (Qwen-Image; their algorithm keys are
accepted and select the same algorithm).

`tests/data/verl_omni_recipes/<name>.txt` holds the key=value arguments of a verl-omni recipe's
`main_diffusion_v1` command, one per line, exactly as the shell passes them (see each file's header for
its source and commit). The test points the four local paths (prompt files, model, reward file) at
files that exist here, runs the rest through the code path of `omniflow validate`, and asserts that
exactly the documented keys are refused, each with a reason, all in one error. A key OmniFlow can do
as it says is accepted (e.g. `data.truncation=error`, `actor.fsdp_config.model_dtype=bfloat16` under
LoRA, `fsdp_config.param_offload=False`); the section "verl-omni recipes: keys OmniFlow refuses" of docs/configuration.md
gives each refusal in one line.

To regenerate a file from a verl-omni checkout: replace `python3 -m verl_omni.trainer.main_diffusion_v1`
by `printf '%s\\n'` in the script (and drop its checkpoint-backend pre-flight), run it with
`WORKSPACE='$HOME'`, and keep the header.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from omni_core.config import ConfigError
from omni_core.validation import prepare_run_config

RECIPES = Path(__file__).parent / "data" / "verl_omni_recipes"

# Refused in both recipes, with the reason in short (the error carries the full reason and the fix).
REFUSED_IN_BOTH = {
    "actor_rollout_ref.model.custom_chat_template",  # the raw prompt goes to the pipeline's text encoders
    "actor_rollout_ref.model.extra_tokenizers",  # the pipeline's own tokenizers are used
    "actor_rollout_ref.rollout.name",  # vllm_omni: OmniFlow rolls out with diffusers
    "actor_rollout_ref.rollout.tensor_model_parallel_size",  # vLLM-Omni knob
    "actor_rollout_ref.rollout.load_format",  # vLLM-Omni knob
    "actor_rollout_ref.rollout.engine_kwargs",  # vLLM-Omni knob (+...vllm_omni.max_num_seqs)
    "actor_rollout_ref.rollout.max_prompt_embed_length",  # the encoders fix the embedding length
    "reward.reward_model",  # a served reward model on its own pool (every reward.reward_model.* key)
    "reward.num_workers",  # rewards are scored inside the rollout workers (streaming reward)
}

# The Qwen-Image recipes of the policy-gradient family (GRPO-Guard, Flow-DPPO, MixGRPO, rollout correction): the algorithm keys are accepted; what is refused is the
# serving engine, CPU offload and the served reward model, plus a pool of 4 training ranks with verl-omni's default FSDP
# engine (OmniFlow's default strategy is one torch rank; on a machine of fewer than 4 cores the rank count too).
REFUSED_QWEN_IMAGE = {
    "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "actor_rollout_ref.rollout.load_format",
    "actor_rollout_ref.rollout.layered_summon",  # vLLM-Omni knob
    "actor_rollout_ref.actor.fsdp_config.param_offload",  # True: CPU offload needs the FSDP engine
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
    "actor_rollout_ref.actor.strategy",  # unset: verl-omni's fsdp on 4 ranks; OmniFlow's default trains one rank
    "reward.reward_model",
    "reward.num_workers",
} | ({"trainer.n_gpus_per_node"} if (os.cpu_count() or 1) < 4 else set())  # 4 training ranks: one per core on cpu

EXPECTED_REFUSED: dict[str, set[str]] = {
    "run_sd35_medium_ocr_lora_v1": REFUSED_IN_BOTH,
    "run_sd35_medium_ocr_lora_v1_separate_async": REFUSED_IN_BOTH
    | {
        "actor_rollout_ref.rollout.mode",  # vLLM-Omni knob
        "actor_rollout_ref.rollout.checkpoint_engine",  # weight sync to a vLLM-Omni server
        "trainer.v1.separate_async.sync_compatible",  # 1: nothing to pause (requests name their weights)
    },
    "run_qwen_image_ocr_lora_grpoguard": REFUSED_QWEN_IMAGE,
    "run_qwen_image_ocr_lora_flowdppo": REFUSED_QWEN_IMAGE,
    "run_qwen_image_ocr_lora_mixgrpo": REFUSED_QWEN_IMAGE,
    "run_qwen_image_ocr_lora_rollout_corr": REFUSED_QWEN_IMAGE,
    # DiffusionNFT's recipe sets a clip ratio, which its loss does not read (it has no ratio), and a reference micro-batch
    # of 32 samples where its update's is 12 (the reference's velocity is computed inside the update, at its points).
    "run_qwen_image_ocr_lora_diffusionnft": REFUSED_QWEN_IMAGE
    | {"actor_rollout_ref.actor.diffusion_loss.clip_ratio", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"},
    # Online Diffusion-DPO: the same serving, offload and rank keys, and model.external_lib, verl-omni's own module of its
    # Qwen-Image DPO adapter (OmniFlow's is selected by model.algorithm=dpo); every DPO key is accepted.
    "run_qwen_image_online_dpo_lora": REFUSED_QWEN_IMAGE | {"actor_rollout_ref.model.external_lib"},
    # Offline Diffusion-DPO: the chat template and the serving engine as in every recipe, and its SD3 DPO adapter's
    # module (OmniFlow's is selected by model.algorithm=dpo); the pairs data set (data.custom_cls) is read as written.
    "run_sd35_medium_offline_dpo_lora": {
        "actor_rollout_ref.model.custom_chat_template",
        "actor_rollout_ref.model.external_lib",
        "actor_rollout_ref.rollout.name",
    },
    # On-policy distillation: the SD3.5 recipes' serving and reward-model keys, and diffusion_loss.clip_ratio, which
    # distill_kl does not read (no ratio; verl-omni's loss ignores it too).
    "run_sd35_medium_ocr_distill": REFUSED_IN_BOTH | {"actor_rollout_ref.actor.diffusion_loss.clip_ratio"},
}
# Each recipe's script in verl-omni's examples/ (the data file's header names it).
SCRIPTS = {
    "run_sd35_medium_ocr_lora_v1": "flowgrpo_trainer/sd35/run_sd35_medium_ocr_lora_v1.sh",
    "run_sd35_medium_ocr_lora_v1_separate_async": "flowgrpo_trainer/sd35/run_sd35_medium_ocr_lora_v1_separate_async.sh",
    "run_qwen_image_ocr_lora_grpoguard": "grpoguard_trainer/qwen_image/run_qwen_image_ocr_lora.sh",
    "run_qwen_image_ocr_lora_flowdppo": "flowdppo_trainer/qwen_image/run_qwen_image_ocr_lora.sh",
    "run_qwen_image_ocr_lora_mixgrpo": "mixgrpo_trainer/qwen_image/run_qwen_image_ocr_lora_mixgrpo.sh",
    "run_qwen_image_ocr_lora_rollout_corr": "flowgrpo_trainer/qwen_image/run_qwen_image_ocr_lora_rollout_corr.sh",
    "run_qwen_image_ocr_lora_diffusionnft": "diffusionnft_trainer/qwen_image/run_qwen_image_ocr_lora.sh",
    "run_qwen_image_online_dpo_lora": "dpo_trainer/qwen_image/run_qwen_image_online_dpo_lora.sh",
    "run_sd35_medium_offline_dpo_lora": "dpo_trainer/sd35/run_sd35_medium_offline_dpo_lora.sh",
    "run_sd35_medium_ocr_distill": "diffusionopd_trainer/sd35/run_sd35_medium_ocr_distill.sh",
}

# Keys whose recipe value is a path on the recipe author's machine: pointed at local files here.
LOCAL_PATHS = ("data.train_files", "data.val_files", "actor_rollout_ref.model.path", "reward.custom_reward_function.path")
TEACHER = "distillation.teacher_models.teacher_model.model_path"  # the distillation recipe's, pointed at a tiny teacher


def recipe_overrides(name: str) -> list[str]:
    lines = (RECIPES / f"{name}.txt").read_text().splitlines()
    return [line for line in lines if line.strip() and not line.startswith("#")]


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+")


@pytest.fixture(scope="module")
def local_paths(tiny_qwen_image_dir, tmp_path_factory) -> dict[str, str]:
    from test_offline_dpo import write_pair_file

    from omni_core.models.tiny import build_tiny_pipeline

    # The SD3.5 recipes sample 384 px: a tiny SD3 whose position table covers that side (the default one's covers 128).
    tiny_sd3_dir = build_tiny_pipeline(tmp_path_factory.mktemp("recipe_sd3"), "sd3", seed=0, max_image_size=512)

    reward = tmp_path_factory.mktemp("recipe_reward") / "genrm_ocr.py"
    reward.write_text("def compute_score_ocr(data_source, solution_image, ground_truth, extra_info):\n    return 0.0\n")
    prompts = "pkg://omni_core/assets/prompts"
    return {
        "data.train_files": f"{prompts}/train.txt",
        "data.val_files": f"{prompts}/val.txt",
        "actor_rollout_ref.model.path": str(tiny_sd3_dir),
        "qwen-image": str(tiny_qwen_image_dir),  # the model of a qwen_image recipe
        "reward.custom_reward_function.path": str(reward),
        "pairs": str(write_pair_file(tmp_path_factory.mktemp("recipe_pairs"))),  # the training file of an offline recipe
        TEACHER: str(tiny_sd3_dir),  # a teacher of the student's architecture and scheduler (here: the same weights)
    }


def localised(name: str, local_paths: dict[str, str]) -> list[str]:
    """The recipe with its local paths pointed here: the model at a tiny one of the recipe's architecture."""
    paths = dict(local_paths)
    if "qwen_image" in name:
        paths["actor_rollout_ref.model.path"] = local_paths["qwen-image"]
    if "offline" in name:
        paths["data.train_files"] = local_paths["pairs"]
    out = []
    for override in recipe_overrides(name):
        key = _key(override)
        out.append(f"{key}={paths[key]}" if key in (*LOCAL_PATHS, TEACHER) else override)
    return out


def validated_without_refused(name: str, local_paths: dict[str, str], also_drop: tuple[str, ...] = ()):
    """The recipe's config once its refused keys (and the keys starting with `also_drop`) are removed, validated as
    `omniflow validate` does, with the console logger only."""
    kept = [
        o
        for o in localised(name, local_paths)
        if not any(_key(o) == k or _key(o).startswith(k + ".") for k in EXPECTED_REFUSED[name])
        and not (also_drop and _key(o).startswith(also_drop))
    ]
    return prepare_run_config(None, [*kept, "trainer.logger=[console]"])


def test_the_recipe_files_are_the_scripts_arguments():
    for name in EXPECTED_REFUSED:
        text = (RECIPES / f"{name}.txt").read_text()
        assert f"examples/{SCRIPTS[name]} at commit " in text.splitlines()[0]
        keys = [_key(o) for o in recipe_overrides(name)]
        local = set(LOCAL_PATHS) - ({"reward.custom_reward_function.path"} if "offline" in name else set())  # no reward
        assert len(keys) == len(set(keys)) and local <= set(keys)
        assert all(
            "$" not in o or o.startswith(("data.train_files=$HOME", "data.val_files=$HOME")) for o in recipe_overrides(name)
        )


@pytest.mark.parametrize("name", sorted(EXPECTED_REFUSED))
def test_omniflow_validate_refuses_exactly_the_documented_keys_with_reasons(name, local_paths):
    with pytest.raises(ConfigError) as err:
        prepare_run_config(None, localised(name, local_paths))  # what `omniflow validate` runs
    problems = err.value.problems
    assert {p.key for p in problems} == EXPECTED_REFUSED[name], str(err.value)
    assert len(problems) == len(EXPECTED_REFUSED[name]), "one problem per refused key"
    for p in problems:
        # A reason and a way out, never a bare "unknown key".
        assert "unknown key" not in p.message and len(p.message) > 40, str(p)
    # Every key of the recipe that is not refused was accepted, and the refused ones name the recipe's key.
    recipe_keys = {_key(o) for o in recipe_overrides(name)}
    named = EXPECTED_REFUSED[name] - {"actor_rollout_ref.actor.strategy"}  # unset in the Qwen-Image recipes: the default
    assert all(any(k == p or k.startswith(p + ".") for k in recipe_keys) for p in named)


@pytest.mark.parametrize("name", ["run_sd35_medium_ocr_lora_v1", "run_sd35_medium_ocr_lora_v1_separate_async"])
def test_the_recipe_validates_once_the_refused_keys_are_removed(name, local_paths):
    """Nothing else in the recipe is a problem: without the refused keys (rollout name, logger, device counts
    and trainer mode set back to OmniFlow's values) the config passes, and the keys it
    carries over keep their recipe values."""
    config = validated_without_refused(name, local_paths)
    arr = config.actor_rollout_ref
    assert config.trainer.n_gpus_per_node == 2 and arr.actor.strategy == "fsdp2"  # two sharded ranks, as in the recipe
    assert arr.actor.fsdp_config.model_dtype == "bfloat16" and arr.model.lora_rank == 32
    assert arr.rollout.log_prob_micro_batch_size_per_gpu == 8 and config.trainer.log_val_generations == 8
    assert config.data.truncation == "error" and arr.rollout.algo.sde_type == "cps"


def test_the_omniflow_command_reports_every_refused_key_in_one_error(local_paths, capsys):
    from omniflow.flows.cli import main

    name = "run_sd35_medium_ocr_lora_v1_separate_async"
    assert main(["validate", *localised(name, local_paths)]) == 2
    err = capsys.readouterr().err
    n = len(EXPECTED_REFUSED[name])
    assert f"invalid OmniFlow config ({n} problems)" in err
    assert all(f"  - {key}" in err for key in EXPECTED_REFUSED[name])


@pytest.mark.parametrize(
    ("name", "loss_keys"),
    [
        ("run_qwen_image_ocr_lora_grpoguard", {"loss_mode": "grpo_guard", "clip_ratio": 2e-6, "adv_clip_max": 5.0}),
        ("run_qwen_image_ocr_lora_flowdppo", {"loss_mode": "flow_dppo", "kl_mask_threshold": 1e-5, "add_kl_coefficient": True}),
        ("run_qwen_image_ocr_lora_mixgrpo", {"loss_mode": "flow_grpo"}),
        ("run_qwen_image_ocr_lora_rollout_corr", {"loss_mode": "flow_grpo"}),
    ],
)
def test_a_policy_gradient_family_recipe_selects_its_loss_by_the_same_keys(name, loss_keys, local_paths):
    """Without the refused keys and the training rank count (OmniFlow's default: one torch rank), the recipe validates
    and its `diffusion_loss` keys carry over with the recipe's values: the same loss, selected by the same keys."""
    config = validated_without_refused(name, local_paths, ("trainer.n_gpus_per_node",))
    loss = config.actor_rollout_ref.actor.diffusion_loss
    assert {key: getattr(loss, key) for key in loss_keys} == loss_keys
    assert config.actor_rollout_ref.rollout.algo.sde_type == "sde" and config.actor_rollout_ref.rollout.n == 16
    if "rollout_corr" in name:  # verl's rollout correction, in bypass mode: the RS mask per SDE step
        rc = config.algorithm.rollout_correction
        assert (rc.bypass_mode, rc.rollout_is, rc.rollout_is_threshold) == (True, "sequence", 2.0)
        assert (rc.rollout_rs, rc.rollout_rs_threshold) == ("seq_mean_k1", "0.5_2.0")
    if "mixgrpo" in name:  # MixGRPO: the sampling adapter and its window schedule
        algo = config.actor_rollout_ref.rollout.algo
        assert config.actor_rollout_ref.model.algorithm == "mix_grpo"
        assert (algo.sample_strategy, algo.sde_window_seed, algo.sde_window_size, algo.sde_window_range) == (
            "random",
            42,
            2,
            (0, 5),
        )


def test_the_diffusion_nft_recipe_selects_diffusion_nft_by_the_same_keys(local_paths):
    """Without the refused keys and the rank count, verl-omni's DiffusionNFT recipe validates with its DiffusionNFT keys
    at the recipe's values: the ODE rollout with the old policy, the forward-process loss and its old-policy schedule."""
    name = "run_qwen_image_ocr_lora_diffusionnft"
    # One rank here, with its one rollout worker in it (the hybrid engine, which DiffusionNFT's old policy needs); its
    # reference micro-batch of 32 is refused above (the update's is the recipe's 12).
    config = validated_without_refused(
        name, local_paths, ("trainer.n_gpus_per_node", "actor_rollout_ref.rollout.agent.num_workers")
    )
    arr, algo = config.actor_rollout_ref, config.algorithm
    assert (arr.model.algorithm, arr.model.model_type, arr.actor.diffusion_loss.loss_mode) == (
        "diffusion_nft",
        "diffusion_nft_model",
        "diffusion_nft",
    )
    assert arr.model.policy_state_adapters == ("default", "old") and arr.rollout.rollout_adapter == "old"
    loss = arr.actor.diffusion_loss
    assert (loss.mix_beta, loss.ref_kl_coef, loss.adv_clip_max) == (0.1, 0.0001, 5.0)
    assert (algo.trainer_type, algo.timestep_fraction, algo.adv_mode) == ("direct_preference", 1.0, "continuous")
    assert (algo.old_policy_decay_schedule, algo.old_policy_update_interval) == ("delayed_linear_to_0_999", 2)


def test_the_online_dpo_recipe_selects_diffusion_dpo_by_the_same_keys(local_paths):
    """Without the refused keys and the rank count, verl-omni's online Diffusion-DPO recipe validates with its DPO keys at
    the recipe's values: the ODE rollout without log-probs, the pairs, the DPO loss and its beta; a mini-batch of 16
    prompts is 16 pairs (32 samples) in micro-batches of 8, and the reference runs in the update's micro-batches (8)."""
    name = "run_qwen_image_online_dpo_lora"
    config = validated_without_refused(name, local_paths, ("trainer.n_gpus_per_node",))
    arr, algo = config.actor_rollout_ref, config.algorithm
    assert (arr.model.algorithm, arr.model.model_type, arr.actor.diffusion_loss.loss_mode) == (
        "dpo",
        "diffusion_dpo_model",
        "dpo",
    )
    assert (algo.trainer_type, algo.sample_source, algo.paired_preference) == ("direct_preference", "online", True)
    assert arr.actor.diffusion_loss.dpo_beta == 100.0 and not arr.rollout.calculate_log_probs and arr.rollout.n == 16
    assert (arr.actor.ppo_mini_batch_size, arr.actor.ppo_micro_batch_size_per_gpu) == (16, 8)
    assert arr.ref.log_prob_micro_batch_size_per_gpu == 8 and arr.model.lora_rank == 64


def test_the_offline_dpo_recipe_selects_offline_diffusion_dpo_by_the_same_keys(local_paths):
    """Without the refused keys, verl-omni's offline Diffusion-DPO recipe validates with its keys at the recipe's values:
    the pairs data set, the DPO loss and beta, a mini-batch of 4 pairs (8 samples) in micro-batches of 8 samples, and
    the training forward's guidance (`model.pipeline.guidance_scale`, OmniFlow's one pipeline setting with no rollout)."""
    config = validated_without_refused("run_sd35_medium_offline_dpo_lora", local_paths)
    arr, algo = config.actor_rollout_ref, config.algorithm
    assert (algo.trainer_type, algo.sample_source, algo.paired_preference) == ("direct_preference", "offline", True)
    assert (arr.model.algorithm, arr.actor.diffusion_loss.loss_mode, arr.actor.diffusion_loss.dpo_beta) == ("dpo", "dpo", 100.0)
    assert config.data.custom_cls.name == "OfflineDPODataset" and config.data.train_batch_size == 16
    assert (arr.actor.ppo_mini_batch_size, arr.actor.ppo_micro_batch_size_per_gpu) == (4, 8)
    assert arr.rollout.pipeline.guidance_scale == 4.0 and arr.model.lora_rank == 32
    assert config.trainer.resume_mode == "disable" and not config.trainer.val_before_train


def test_the_distillation_recipe_selects_on_policy_distillation_by_the_same_keys(local_paths):
    """Without the refused keys, verl-omni's on-policy distillation recipe validates with its keys at the recipe's values:
    the teacher switch and path, the distill_kl loss on Flow-GRPO's SDE sampler (CPS), no reference KL."""
    config = validated_without_refused("run_sd35_medium_ocr_distill", local_paths)
    arr = config.actor_rollout_ref
    assert config.distillation.enabled and config.distillation.teacher_models.teacher_model.model_path == local_paths[TEACHER]
    assert (arr.actor.diffusion_loss.loss_mode, arr.actor.use_kl_loss, arr.actor.use_distill_loss) == ("distill_kl", False, False)
    assert (arr.model.algorithm, arr.rollout.algo.sde_type, arr.rollout.algo.sde_window_size) == ("flow_grpo", "cps", 3)
    assert config.trainer.n_gpus_per_node == 2 and arr.actor.strategy == "fsdp2"
