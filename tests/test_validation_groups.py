"""Validation as a light, grouped rule set: what `omniflow validate` imports, the run's Ray budget shared
with the cluster check, the reward and tracking rules, and the name lists that stand in for registries."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from omni_core.config import ConfigError, load_config
from omni_core.device import accelerator_driver_present
from omni_core.distributed.ray_cluster import check_cluster_devices
from omni_core.resources import run_resource_budget
from omni_core.validation import config_problems, prepare_run_config

CPU_ONLY = {"cuda": 0, "npu": 0, "cpu": 2}
HEAVY = {"torch", "diffusers", "transformers", "ray", "prefect", "peft", "pyarrow", "PIL"}


def _fresh_interpreter(code: str) -> dict:
    """Run `code` in a new Python process; it prints one JSON line last."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------ light imports
@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["trainer.v1.trainer_mode=separate_async"],  # reached diffusers through the trainer modes before
        ["trainer.device=cpu", "actor_rollout_ref.model.lora_rank=4", "trainer.logger=[console,file,tensorboard]"],
        ["reward.reward_functions=[jpeg_compressibility]", "algorithm.adv_estimator=nope"],
    ],
)
def test_validating_a_config_imports_no_heavy_package(overrides, tiny_sd3_dir):
    result = _fresh_interpreter(
        f"""
        import json, sys
        from omni_core.config import ConfigError
        from omni_core.validation import prepare_run_config
        try:
            prepare_run_config(None, {[*overrides, f"actor_rollout_ref.model.path={tiny_sd3_dir}"]!r})
            problems = []
        except ConfigError as err:
            problems = err.keys
        print(json.dumps({{"modules": sorted({{m.split(".")[0] for m in sys.modules}}), "problems": problems}}))
        """
    )
    # torch is imported only to probe a machine that shows an accelerator driver.
    expected_heavy = {"torch"} if accelerator_driver_present() else set()
    assert HEAVY & set(result["modules"]) == expected_heavy
    if "trainer.v1.trainer_mode=separate_async" in overrides:  # no standalone rollout pool given
        assert "actor_rollout_ref.rollout.nnodes" in result["problems"]
    if "algorithm.adv_estimator=nope" in overrides:
        assert result["problems"] == ["algorithm.adv_estimator"]


def test_omniflow_validate_answers_without_heavy_imports(tiny_sd3_dir):
    """The CLI path: `python -X importtime` lists every module the command imported."""
    out = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "omniflow.flows.cli",
            "validate",
            f"actor_rollout_ref.model.path={tiny_sd3_dir}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.startswith("config OK: trainer.v1.trainer_mode=sync"), out.stderr[-2000:]
    imported = {line.split("|")[-1].strip().split(".")[0] for line in out.stderr.splitlines() if line.startswith("import time:")}
    expected_heavy = {"torch"} if accelerator_driver_present() else set()
    assert HEAVY & imported == expected_heavy


# ------------------------------------------------------------------------------------ one Ray budget
def test_the_budget_is_counted_by_hand_and_shared_with_the_cluster_check():
    units = "transfer_queue.backend.SimpleStorage.num_data_storage_units=2"  # null would size them from this machine
    cfg = load_config(overrides=["actor_rollout_ref.rollout.agent.num_workers=2", units])
    budget = run_resource_budget(cfg)
    # TransferQueue: controller 1 + 2 storage units; training actor 1; 2 rollout workers; the fit_epoch task 1.
    assert budget.cpus == {"transfer_queue": 3, "training_actor": 1, "rollout_workers": 2, "fit_epoch_task": 1}
    assert budget.total_cpus == 7 and budget.gpus == 0

    enough = load_config(overrides=["actor_rollout_ref.rollout.agent.num_workers=2", units, "ray_kwargs.ray_init.num_cpus=7"])
    assert [p.key for p in config_problems(enough, CPU_ONLY) if p.key.startswith("ray_kwargs")] == []
    check_cluster_devices(enough, {"CPU": 7.0})

    # One short: validation refuses it before Ray starts (before, it only counted 6 and let the run hang
    # until the cluster check), and the cluster check agrees.
    short = load_config(overrides=["actor_rollout_ref.rollout.agent.num_workers=2", units, "ray_kwargs.ray_init.num_cpus=6"])
    problems = [p for p in config_problems(short, CPU_ONLY) if p.key == "ray_kwargs.ray_init.num_cpus"]
    assert len(problems) == 1 and "reserves 7" in str(problems[0]) and "fit_epoch_task 1" in str(problems[0])
    with pytest.raises(ConfigError, match="reserves 7"):
        check_cluster_devices(short, {"CPU": 6.0})


def test_gpus_in_the_budget_come_from_the_trainer_keys():
    cfg = load_config(overrides=["trainer.device=cuda", "trainer.n_gpus_per_node=4", "trainer.nnodes=2"])
    assert run_resource_budget(cfg).gpus == 8
    with pytest.raises(ConfigError, match="asks for 8 GPU"):
        check_cluster_devices(cfg, {"CPU": 64.0, "GPU": 4.0})


def test_a_local_cluster_that_declares_too_few_gpus_is_a_config_problem(tiny_sd3_dir):
    one_gpu = {"cuda": 1, "npu": 0, "cpu": 2}
    base = [f"actor_rollout_ref.model.path={tiny_sd3_dir}", "trainer.device=cuda"]

    def problems(*overrides: str) -> dict[str, str]:
        return {p.key: str(p) for p in config_problems(load_config(overrides=[*base, *overrides]), one_gpu)}

    assert problems() == {} and problems("ray_kwargs.ray_init.num_gpus=1") == {}
    found = problems("ray_kwargs.ray_init.num_gpus=0")
    assert list(found) == ["ray_kwargs.ray_init.num_gpus"] and "needs 1" in found["ray_kwargs.ray_init.num_gpus"]
    # Joining a cluster by address: Ray refuses num_gpus there, so validation names it first.
    joined = problems("ray_kwargs.ray_init.address=auto", "ray_kwargs.ray_init.num_gpus=1")
    assert list(joined) == ["ray_kwargs.ray_init.num_gpus"] and "joins an existing" in joined["ray_kwargs.ray_init.num_gpus"]


# ------------------------------------------------------------------------------------ ray.init arguments
def test_ray_init_arguments_reach_ray_init_and_env_vars_merge_with_the_users_winning(monkeypatch):
    from omni_core.distributed.ray_cluster import NAMESPACE, PASSED_ENV_VARS, ray_init_kwargs

    for name in PASSED_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    monkeypatch.setenv("TQ_LOGGING_LEVEL", "ERROR")
    local = load_config(
        overrides=[
            "ray_kwargs.ray_init.num_gpus=2",
            "ray_kwargs.ray_init.resources={accel: 4}",
            "ray_kwargs.ray_init.object_store_memory=100000000",
            "ray_kwargs.ray_init._temp_dir=/tmp/omniflow-ray",
            "ray_kwargs.ray_init.runtime_env={env_vars: {TQ_LOGGING_LEVEL: DEBUG, MINE: '1'}, working_dir: /src}",
        ]
    )
    kwargs = ray_init_kwargs(local)
    assert {k: kwargs[k] for k in ("num_cpus", "num_gpus", "resources", "object_store_memory", "_temp_dir")} == {
        "num_cpus": 16,
        "num_gpus": 2,
        "resources": {"accel": 4.0},
        "object_store_memory": 100000000,
        "_temp_dir": "/tmp/omniflow-ray",
    }
    assert kwargs["include_dashboard"] is False and kwargs["namespace"] == NAMESPACE and "address" not in kwargs
    # OmniFlow's PREFECT_API_URL joins the user's env vars; the user's TQ_LOGGING_LEVEL wins over OmniFlow's.
    assert kwargs["runtime_env"] == {
        "env_vars": {"PREFECT_API_URL": "http://127.0.0.1:4200/api", "TQ_LOGGING_LEVEL": "DEBUG", "MINE": "1"},
        "working_dir": "/src",
    }
    assert "PREFECT_API_URL" in PASSED_ENV_VARS and "TQ_LOGGING_LEVEL" in PASSED_ENV_VARS
    assert {"TQ_NUM_THREADS", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"} <= set(PASSED_ENV_VARS)
    # Unset keys stay out of ray.init (Ray's own defaults apply); joining by address passes what Ray takes there.
    assert "num_gpus" not in ray_init_kwargs(load_config())
    joined = ray_init_kwargs(load_config(overrides=["ray_kwargs.ray_init.address=auto"]))
    assert set(joined) == {"address", "namespace", "runtime_env", "log_to_driver", "logging_level"}
    assert joined["runtime_env"]["env_vars"]["PREFECT_API_URL"] == "http://127.0.0.1:4200/api"


def test_unknown_ray_init_keys_name_the_accepted_ones():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["ray_kwargs.ray_init.log_to_driver=false"])
    assert err.value.keys == ["ray_kwargs.ray_init.log_to_driver"]
    assert (
        "accepts address, num_cpus, num_gpus, resources, object_store_memory, _temp_dir, runtime_env, include_dashboard"
        in str(err.value)
    )


# ------------------------------------------------------------------------------------ rule groups
def test_reward_rules_name_the_entry_and_the_fix(tiny_sd3_dir, tmp_path):
    good = tmp_path / "score.py"
    good.write_text("def compute_score(data_source, solution_image, ground_truth, extra_info):\n    return 0.0\n")
    base = [f"actor_rollout_ref.model.path={tiny_sd3_dir}"]

    def problems(*overrides: str) -> dict[str, str]:
        return {p.key: str(p) for p in config_problems(load_config(overrides=[*base, *overrides]), CPU_ONLY)}

    assert problems(f"reward.reward_functions=[{{path: {good}, weight: 2}}, jpeg_compressibility]") == {}
    found = problems(f"reward.reward_functions=[{{path: {tmp_path / 'missing.py'}}}, hpsv3]")
    assert set(found) == {"reward.reward_functions[0].path", "reward.reward_functions[1].name"}
    assert "jpeg_compressibility, jpeg_incompressibility" in found["reward.reward_functions[1].name"]
    # Both forms at once: the weighted sum would win and the custom function would be ignored.
    both = problems(f"reward.custom_reward_function.path={good}", "reward.reward_functions=[jpeg_compressibility]")
    assert list(both) == ["reward.custom_reward_function.path"] and "is unused" in both["reward.custom_reward_function.path"]
    assert (
        "no such file"
        in problems(f"reward.custom_reward_function.path={tmp_path / 'nope.py'}")["reward.custom_reward_function.path"]
    )


def test_tensorboard_logger_without_the_package_is_a_config_error(tiny_sd3_dir):
    """A fresh interpreter in which `tensorboard` is not importable (None in sys.modules: Python's own
    marker for a module that must raise ImportError, and `find_spec` then reports it absent)."""
    result = _fresh_interpreter(
        f"""
        import json, sys

        sys.modules["tensorboard"] = None
        from omni_core.config import ConfigError
        from omni_core.validation import prepare_run_config
        out = {{}}
        for logger in ("[console,tensorboard]", "[console,file]"):
            try:
                prepare_run_config(None, ["trainer.logger=" + logger, "actor_rollout_ref.model.path={tiny_sd3_dir}"])
                out[logger] = None
            except ConfigError as err:
                out[logger] = str(err)
        print(json.dumps(out))
        """
    )
    assert result["[console,file]"] is None
    assert "trainer.logger" in result["[console,tensorboard]"] and "pip install tensorboard" in result["[console,tensorboard]"]


def test_prepare_run_config_names_the_experiment(tiny_sd3_dir, tmp_path):
    cfg = prepare_run_config(
        None,
        [f"actor_rollout_ref.model.path={tiny_sd3_dir}", f"trainer.default_local_dir={tmp_path}"],
        experiment_suffix="20261203-030000-brave-otter",
    )
    assert cfg.transfer_queue.enable is True
    assert cfg.trainer.experiment_name == "tiny_sd3_jpeg-20261203-030000-brave-otter"
    assert cfg.trainer.checkpoint_dir == tmp_path / "tiny_sd3_jpeg-20261203-030000-brave-otter"
    assert cfg.trainer.device == "cpu" or accelerator_driver_present()
    # transfer_queue.enable=false was silently forced on before; now it is refused with the reason.
    with pytest.raises(ConfigError) as err:
        prepare_run_config(None, [f"actor_rollout_ref.model.path={tiny_sd3_dir}", "transfer_queue.enable=false"])
    assert err.value.keys == ["transfer_queue.enable"] and "always moves rollouts through the TransferQueue" in str(err.value)


def test_prepare_run_config_reports_key_type_and_cross_field_problems_in_one_error(tiny_sd3_dir):
    """Unknown / refused keys and wrong types no longer hide the cross-field rules: all come in one error,
    and a rule about a key that is already reported (here the dropped train_batch_size) is not repeated."""
    with pytest.raises(ConfigError) as err:
        prepare_run_config(
            None,
            [
                f"actor_rollout_ref.model.path={tiny_sd3_dir}",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=1",  # vLLM knob (key check)
                "actor_rollout_ref.actor.strategy=megatron",  # refused value (key check)
                "data.train_batch_size=abc",  # wrong type (pydantic)
                "trainer.experiment_name=../x",  # cross-field rule (paths)
                "reward.num_workers=2",  # refused when not default (validation)
            ],
        )
    assert sorted(err.value.keys) == [  # each once, in the order the config's keys come
        "actor_rollout_ref.actor.strategy",
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        "data.train_batch_size",
        "reward.num_workers",
        "trainer.experiment_name",
    ]
    assert len(err.value.keys) == 5


# ------------------------------------------------------------------------------------ light name lists
def test_light_name_lists_equal_the_registries():
    from omni_core.algorithms.registry import ADV_ESTIMATORS, LOSS_MODES
    from omni_core.config.algorithm_names import ADV_ESTIMATOR_NAMES, LOSS_MODE_NAMES
    from omni_core.config.trainer_modes import trainer_mode_names
    from omni_core.rewards.names import BUILTIN_REWARD_NAMES
    from omni_core.rewards.plugins import declared_rewards
    from omni_core.rewards.registry import REWARD_FUNCTIONS
    from omni_core.trainers.registry import BUILTIN_MODES, DIFFUSION_TRAINER_REGISTRY, get_diffusion_trainer_cls

    assert set(ADV_ESTIMATORS) == set(ADV_ESTIMATOR_NAMES) == {"flow_grpo", "dance_grpo"}
    assert (
        set(LOSS_MODES) == set(LOSS_MODE_NAMES) == {"flow_grpo", "dance_grpo", "grpo_guard", "flow_dppo", "diffusion_nft", "dpo", "distill_kl", "distill_fm_mse"}
    )
    assert set(REWARD_FUNCTIONS) == set(BUILTIN_REWARD_NAMES) == {"jpeg_compressibility", "jpeg_incompressibility"}
    # The recipe's reward is declared by the installed package, not built in.
    assert declared_rewards()["procedural_geneval"] == "omni_core.recipes.procedural_geneval.verifier"
    get_diffusion_trainer_cls("sync")  # registers the built-in modes
    assert set(BUILTIN_MODES) <= set(DIFFUSION_TRAINER_REGISTRY) and set(BUILTIN_MODES) == {"sync", "separate_async"}
    assert set(trainer_mode_names()) == set(DIFFUSION_TRAINER_REGISTRY)  # what validation reads, one layer down


def test_a_loss_key_set_for_another_loss_is_refused_and_its_default_passes():
    """A table with a pair loss that reads its own `beta`: `beta` changed while flow_grpo trains is refused with the
    loss that reads it; left at its default, or read by the chosen loss, it passes."""
    from omni_core.config.algorithm_names import LossEntry
    from omni_core.validation.algorithm import unread_loss_keys

    table = {
        "flow_grpo": LossEntry("omni_core.algorithms.losses.flow_grpo"),
        "pairs": LossEntry("somewhere.pairs", {"beta": "positive_float"}),
        "pairs_too": LossEntry("somewhere.pairs_too", {"beta": "positive_float"}),
    }
    defaults = {"loss_mode": "flow_grpo", "beta": 5000.0}
    [problem] = unread_loss_keys({"loss_mode": "flow_grpo", "beta": 10.0}, table, defaults)
    assert problem.key == "actor_rollout_ref.actor.diffusion_loss.beta" and problem.value == 10.0
    assert "read only by loss_mode pairs / pairs_too" in problem.message and "loss_mode=pairs" in problem.message
    assert unread_loss_keys({"loss_mode": "flow_grpo", "beta": 5000.0}, table, defaults) == []
    assert unread_loss_keys({"loss_mode": "pairs_too", "beta": 10.0}, table, defaults) == []


def test_a_recipe_reward_validates_without_the_recipe_and_resolves_by_name_in_a_fresh_process(tiny_sd3_dir):
    """A process that only meets the name (a Ray rollout worker scoring a procedural prompt file) finds the recipe's
    reward through the installed entry point; validation accepts the name without importing the recipe."""
    result = _fresh_interpreter(
        f"""
        import json, sys
        from omni_core.validation import prepare_run_config
        prepare_run_config(None, ["reward.reward_functions=[procedural_geneval]",
                                  "actor_rollout_ref.model.path={tiny_sd3_dir}"])
        validated_without = "omni_core.recipes.procedural_geneval" not in sys.modules
        from omni_core.rewards.registry import get_reward_function
        fn = get_reward_function("procedural_geneval")
        print(json.dumps({{"validated_without": validated_without, "fn": f"{{fn.__module__}}.{{fn.__name__}}"}}))
        """
    )
    assert result == {"validated_without": True, "fn": "omni_core.recipes.procedural_geneval.verifier.verifier_reward"}


@pytest.mark.parametrize(
    "module",
    ["omni_core.records", "omni_core.resources", "omni_core.rollout.sampling_params", "omni_core.rollout.request"],
)
def test_shared_records_are_light(module):
    """What flows, tasks, workers and the trainer hand each other imports neither torch nor Ray."""
    result = _fresh_interpreter(
        f"""
        import json, sys
        import {module}
        print(json.dumps({{"modules": sorted({{m.split(".")[0] for m in sys.modules}})}}))
        """
    )
    assert HEAVY & set(result["modules"]) == set()


def test_local_paths_are_made_absolute_in_the_driver(tiny_sd3_dir, tmp_path, monkeypatch):
    """Ray workers start in their raylet's folder: the config they get names the driver's files absolutely
    (checkpoint folder always; model and reward files when they exist locally), a hub id stays as it is."""
    import os
    from pathlib import Path

    from omni_core.validation import prepare_run_config

    monkeypatch.chdir(tmp_path)  # a relative path is relative to the driver's working directory
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "mine.py").write_text(
        "def compute_score(data_source, solution_image, ground_truth, extra_info):\n    return 0.0\n"
    )
    os.symlink(tiny_sd3_dir, tmp_path / "model")
    cfg = prepare_run_config(
        None,
        [
            "actor_rollout_ref.model.path=model",
            "trainer.default_local_dir=out/ckpt",
            "reward.custom_reward_function.path=rewards/mine.py",
        ],
    )
    assert cfg.trainer.default_local_dir == str(tmp_path / "out" / "ckpt")
    assert cfg.actor_rollout_ref.model.path == str(tiny_sd3_dir.resolve())
    assert cfg.reward.custom_reward_function.path == str(tmp_path / "rewards" / "mine.py")
    from omni_core.config.absolute_paths import with_absolute_paths

    hub = load_config(overrides=["actor_rollout_ref.model.path=stabilityai/stable-diffusion-3.5-medium"])
    assert with_absolute_paths(hub).actor_rollout_ref.model.path == "stabilityai/stable-diffusion-3.5-medium"
    assert Path(with_absolute_paths(hub).trainer.default_local_dir).is_absolute()


def _size_problems(model_dir, height: int, width: int) -> dict[str, str]:
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.rollout.pipeline.height={height}",
        f"actor_rollout_ref.rollout.pipeline.width={width}",
    ]
    return {p.key.rsplit(".", 1)[1]: p.message for p in config_problems(load_config(overrides=overrides)) if ".pipeline." in p.key}


def test_image_sides_are_checked_against_the_saved_models_vae_patch_and_position_table(tiny_sd3_dir, tiny_qwen_image_dir, tmp_path):
    """A side the model cannot sample is refused before anything loads (the rollout workers would fail on every sample):
    SD3's largest side is pos_embed_max_size x patch_size x the VAE factor, each read here from the saved configs; the
    packed architectures have no largest side. `make-tiny-model --max-image-size` widens the tiny SD3's table and
    `--vae-scale-factor 8` gives the real models' latent grid."""
    from omni_core.models.tiny import build_tiny_pipeline

    transformer = json.loads((tiny_sd3_dir / "transformer" / "config.json").read_text())
    vae = json.loads((tiny_sd3_dir / "vae" / "config.json").read_text())
    factor = 2 ** (len(vae["block_out_channels"]) - 1)
    step, largest = factor * transformer["patch_size"], transformer["pos_embed_max_size"] * transformer["patch_size"] * factor
    assert (step, largest) == (4, 128)
    assert _size_problems(tiny_sd3_dir, largest, largest) == {}
    too_big = _size_problems(tiny_sd3_dir, 384, largest)
    assert list(too_big) == ["height"] and f"at most {largest}" in too_big["height"]
    off_grid = _size_problems(tiny_sd3_dir, 64, 34)
    assert list(off_grid) == ["width"] and "multiple of 4" in off_grid["width"] and "try 32 or 36" in off_grid["width"]
    # Qwen-Image: 2 x 2 packing of a VAE of factor 2 ** len(temperal_downsample); rotary positions, no largest side.
    qwen_vae = json.loads((tiny_qwen_image_dir / "vae" / "config.json").read_text())
    qwen_step = 2 * 2 ** len(qwen_vae["temperal_downsample"])
    assert _size_problems(tiny_qwen_image_dir, 1024, 1024) == {}
    assert "multiple of" in _size_problems(tiny_qwen_image_dir, 64 + qwen_step // 2, 64)["height"]
    wide = build_tiny_pipeline(tmp_path / "wide-sd3", "sd3", seed=0, max_image_size=384)
    assert _size_problems(wide, 384, 384) == {} and list(_size_problems(wide, 388, 384)) == ["height"]
    # The real models' VAE factor 8: 16 px steps, 32 patches x 2 x 8 = 512 px.
    real_grid = build_tiny_pipeline(tmp_path / "real-grid-sd3", "sd3", seed=0, vae_scale_factor=8)
    assert _size_problems(real_grid, 512, 384) == {} and "multiple of 16" in _size_problems(real_grid, 520, 384)["height"]
    with pytest.raises(ValueError, match="rotary positions"):
        build_tiny_pipeline(tmp_path / "q", "qwen-image", max_image_size=512)


@pytest.mark.parametrize(
    ("class_name", "why"),
    [
        ("QwenImageEditPlusPipeline", "image editing"),
        ("FluxKontextPipeline", "image editing"),
        ("WanPipeline", "video"),
        ("BagelPipeline", "not a pipeline OmniFlow trains"),
        (None, "names no pipeline class"),
    ],
)
def test_a_model_folder_of_a_pipeline_omniflow_does_not_train_is_refused_by_validate(tmp_path, class_name, why):
    """Issue: `validate` said "config OK" for a Wan or Qwen-Image-Edit folder and the run failed at load. The folder's
    model_index.json names the class; the refusal names it, why, and the classes OmniFlow trains."""
    index = {"_diffusers_version": "0.35.0"} | ({"_class_name": class_name} if class_name else {})
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    problems = [p for p in config_problems(load_config(overrides=[f"actor_rollout_ref.model.path={tmp_path}"])) if p.key == "actor_rollout_ref.model.path"]
    assert len(problems) == 1
    assert why in problems[0].message and "QwenImagePipeline, StableDiffusion3Pipeline" in problems[0].message
    if class_name:
        assert class_name in problems[0].message


def test_the_compute_dtype_follows_a_reduced_base_unless_set_and_fp32_on_it_needs_fsdp2(tiny_sd3_dir):
    """`fsdp_config.dtype` null computes in the weights' dtype (verl-omni's recipes: a bf16 LoRA base computes in bf16,
    where autocast(fp32) would be disabled by torch with a warning); an explicit fp32 on a bf16 base is refused on the
    torch strategy (autocast cannot upcast) and accepted on fsdp2 (it gathers the parameters in fp32)."""
    from omni_core.models.placement import training_policy_kwargs

    base = [f"actor_rollout_ref.model.path={tiny_sd3_dir}", "actor_rollout_ref.model.lora_rank=4"]
    bf16 = [*base, "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16"]
    assert training_policy_kwargs(load_config(overrides=base))["compute_dtype"] == torch.float32
    assert training_policy_kwargs(load_config(overrides=bf16))["compute_dtype"] == torch.bfloat16
    key = "actor_rollout_ref.actor.fsdp_config.dtype"
    assert key not in [p.key for p in config_problems(load_config(overrides=bf16))]
    refused = [p for p in config_problems(load_config(overrides=[*bf16, f"{key}=fp32"])) if p.key == key]
    assert len(refused) == 1 and "fsdp2" in refused[0].message
    sharded = [*bf16, f"{key}=fp32", "actor_rollout_ref.actor.strategy=fsdp2", "trainer.n_gpus_per_node=2"]
    assert key not in [p.key for p in config_problems(load_config(overrides=sharded), {"cuda": 0, "npu": 0, "cpu": 2})]


def test_a_reward_function_name_without_its_file_is_refused(tiny_sd3_dir):
    """`reward.custom_reward_function.name` without `path` would be read by nothing (the data_source picks the reward)."""
    model = f"actor_rollout_ref.model.path={tiny_sd3_dir}"
    problems = config_problems(load_config(overrides=[model, "reward.custom_reward_function.name=compute_score_ocr"]))
    assert [p.key for p in problems if p.key.startswith("reward")] == ["reward.custom_reward_function.name"]
    assert not [p for p in config_problems(load_config(overrides=[model])) if p.key.startswith("reward")]
