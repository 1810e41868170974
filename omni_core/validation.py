"""Cross-field config rules: `validate_config` and `validate_attention_consistency`.

verl-omni scatters these over dataclass `__post_init__`s and trainer asserts; OmniFlow checks
them all up front, before any Ray or TransferQueue process starts, and reports every problem of a
config together, each with its key path, the value given and a fix.
"""

from __future__ import annotations

import re
from pathlib import Path

from omni_core.config import ConfigError, ConfigProblem, OmniFlowConfig
from omni_core.data_files import DataFileError, resolve_data_path

# Logical Ray CPUs reserved for a run: TransferQueue controller (1) + each storage unit (1),
# the training actor (1) and each rollout worker (1). See DESIGN.md section 7.
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")

# Actor attention backends (diffusers' dispatcher names) by family, and the rollout backends each pairs with.
ACTOR_ATTN_FAMILIES: dict[str, tuple[str, ...]] = {
    "sdpa": ("native", "_native_npu", "_native_cudnn", "_native_efficient", "_native_flash", "_native_math"),
    "flash": (
        "flash",
        "flash_hub",
        "flash_varlen",
        "flash_varlen_hub",
        "_flash_3",
        "_flash_3_hub",
        "_flash_3_varlen_hub",
        "_flash_varlen_3",
    ),
}
ROLLOUT_ATTN_FAMILIES: dict[str, tuple[str, ...]] = {
    "sdpa": ("TORCH_SDPA",),
    "flash": ("FLASH_ATTN", "FLASH_ATTN_3", "FLASH_ATTN_HUB", "FLASH_ATTN_3_HUB"),
}
_PAIR_EXAMPLE = {"sdpa": ("native", "TORCH_SDPA"), "flash": ("_flash_3", "FLASH_ATTN_3")}


def _family(backend: str, families: dict[str, tuple[str, ...]]) -> str | None:
    return next((fam for fam, names in families.items() if backend in names), None)


def attention_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    """Problems of the actor / rollout attention-backend pair (see `validate_attention_consistency`)."""
    actor = config.actor_rollout_ref.model.attn_backend
    rollout = config.actor_rollout_ref.rollout.rollout_attn_backend
    problems = []
    actor_fam = _family(actor, ACTOR_ATTN_FAMILIES)
    rollout_fam = _family(rollout, ROLLOUT_ATTN_FAMILIES)
    if actor_fam is None:
        known = ", ".join(n for names in ACTOR_ATTN_FAMILIES.values() for n in names)
        problems.append(
            ConfigProblem("actor_rollout_ref.model.attn_backend", f"unknown attention backend; known: {known}", actor)
        )
    if rollout_fam is None:
        known = ", ".join(n for names in ROLLOUT_ATTN_FAMILIES.values() for n in names)
        problems.append(
            ConfigProblem("actor_rollout_ref.rollout.rollout_attn_backend", f"unknown attention backend; known: {known}", rollout)
        )
    if actor_fam and rollout_fam and actor_fam != rollout_fam:
        a, r = _PAIR_EXAMPLE[actor_fam]
        problems.append(
            ConfigProblem(
                "actor_rollout_ref.model.attn_backend",
                f"does not pair with actor_rollout_ref.rollout.rollout_attn_backend={rollout} (kernel differences "
                f"between training and rollout bias the log-prob ratios); a valid pair is "
                f"attn_backend={a} with rollout_attn_backend={r}, or set rollout_attn_backend to one of "
                f"{', '.join(ROLLOUT_ATTN_FAMILIES[actor_fam])}",
                actor,
            )
        )
    return problems


def validate_attention_consistency(config: OmniFlowConfig) -> None:
    """The actor's `attn_backend` must pair with the rollout's `rollout_attn_backend`.

    native / SDPA-family backends pair with TORCH_SDPA; flash-family ones with the FLASH_ATTN family.
    """
    problems = attention_problems(config)
    if problems:
        raise ConfigError(problems)


def _next_multiple(value: int, divisor: int) -> int:
    return ((value + divisor - 1) // divisor) * divisor


def config_problems(config: OmniFlowConfig, device_counts: dict[str, int] | None = None) -> list[ConfigProblem]:
    """Every cross-field problem of `config` (empty when it is valid)."""
    from omni_core.algorithms.registry import ADV_ESTIMATORS, LOSS_MODES
    from omni_core.device import available_devices, detect_device
    from omni_core.trainers.registry import registered_modes

    p: list[ConfigProblem] = []
    data, arr, trainer = config.data, config.actor_rollout_ref, config.trainer
    actor, rollout, model = arr.actor, arr.rollout, arr.model
    mode = trainer.v1.trainer_mode

    if not trainer.use_v1:
        p.append(
            ConfigProblem(
                "trainer.use_v1", "OmniFlow implements only the v1 (TransferQueue) trainer; set trainer.use_v1=true", False
            )
        )
    modes = registered_modes()
    if mode not in modes:
        p.append(ConfigProblem("trainer.v1.trainer_mode", f"unknown trainer mode; available: {', '.join(modes)}", mode))

    # Batch arithmetic (verl-omni trainer asserts).
    tbs, mbs = data.train_batch_size, actor.ppo_mini_batch_size
    if tbs % mbs:
        p.append(
            ConfigProblem(
                "data.train_batch_size",
                f"must be divisible by actor_rollout_ref.actor.ppo_mini_batch_size={mbs}; try {_next_multiple(tbs, mbs)}",
                tbs,
            )
        )
    mini_samples = mbs * rollout.n
    micro = actor.ppo_micro_batch_size_per_gpu
    if mini_samples % micro:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                f"must divide a mini-batch of ppo_mini_batch_size x rollout.n = {mbs} x {rollout.n} = {mini_samples} samples",
                micro,
            )
        )
    if data.gen_batch_size and tbs % data.gen_batch_size:
        p.append(ConfigProblem("data.gen_batch_size", f"must divide data.train_batch_size={tbs}", data.gen_batch_size))
    if rollout.n < 2:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.rollout.n",
                "GRPO needs at least 2 samples per prompt (a group of one has advantage 0 and teaches nothing); use n >= 2",
                rollout.n,
            )
        )

    # Trainer modes.
    sa = trainer.v1.separate_async
    if mode == "separate_async":
        from omni_core.trainers.modes import SEPARATE_ASYNC_NOT_IMPLEMENTED

        p.append(ConfigProblem("trainer.v1.trainer_mode", SEPARATE_ASYNC_NOT_IMPLEMENTED.split("; ")[0] + "; use sync", mode))
        if tbs % sa.parameter_sync_step:
            p.append(
                ConfigProblem(
                    "data.train_batch_size",
                    f"must be divisible by trainer.v1.separate_async.parameter_sync_step={sa.parameter_sync_step} in separate_async mode",
                    tbs,
                )
            )
        if tbs != mbs:
            p.append(
                ConfigProblem(
                    "actor_rollout_ref.actor.ppo_mini_batch_size",
                    f"must equal data.train_batch_size={tbs} in separate_async mode (one update per sampled batch)",
                    mbs,
                )
            )
        if rollout.nnodes <= 0:
            p.append(
                ConfigProblem(
                    "actor_rollout_ref.rollout.nnodes",
                    "separate_async needs a standalone rollout pool; set actor_rollout_ref.rollout.nnodes >= 1",
                    rollout.nnodes,
                )
            )
    if trainer.v1.sampler.drop_incomplete_groups and mode != "sync":
        p.append(
            ConfigProblem(
                "trainer.v1.sampler.drop_incomplete_groups",
                f"is supported only with trainer.v1.trainer_mode=sync (got {mode}); set it to false",
                True,
            )
        )

    # SDE window inside the denoising steps (the last step has sigma_next = 0 and cannot be an SDE step).
    steps = rollout.pipeline.num_inference_steps
    window, window_range = rollout.algo.sde_window_size, rollout.algo.sde_window_range
    if window is not None and window > steps - 1:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.rollout.algo.sde_window_size",
                f"must be <= rollout.pipeline.num_inference_steps - 1 = {steps - 1}",
                window,
            )
        )
    if window_range is not None:
        start, end = window_range
        if not 0 <= start < end <= steps - 1:
            p.append(
                ConfigProblem(
                    "actor_rollout_ref.rollout.algo.sde_window_range",
                    f"must satisfy 0 <= start < end <= num_inference_steps - 1 = {steps - 1}",
                    list(window_range),
                )
            )
        elif window is not None and window <= steps - 1 and end - start < window:
            p.append(
                ConfigProblem(
                    "actor_rollout_ref.rollout.algo.sde_window_range",
                    f"is narrower than actor_rollout_ref.rollout.algo.sde_window_size={window}",
                    list(window_range),
                )
            )

    # Algorithm names (registries) and the one algorithm OmniFlow implements.
    if model.algorithm not in LOSS_MODES:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.model.algorithm",
                f"unknown or unsupported algorithm; available: {', '.join(LOSS_MODES)}",
                model.algorithm,
            )
        )
    if actor.diffusion_loss.loss_mode not in LOSS_MODES:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.actor.diffusion_loss.loss_mode",
                f"unknown loss mode; available: {', '.join(LOSS_MODES)}",
                actor.diffusion_loss.loss_mode,
            )
        )
    if config.algorithm.adv_estimator not in ADV_ESTIMATORS:
        p.append(
            ConfigProblem(
                "algorithm.adv_estimator",
                f"unknown advantage estimator; available: {', '.join(ADV_ESTIMATORS)}",
                config.algorithm.adv_estimator,
            )
        )
    if config.algorithm.rollout_correction.bypass_mode and not rollout.calculate_log_probs:
        p.append(
            ConfigProblem(
                "algorithm.rollout_correction.bypass_mode",
                "uses the rollout's log-probs; set actor_rollout_ref.rollout.calculate_log_probs=true",
                True,
            )
        )

    # LoRA.
    if model.lora_rank < 0:
        p.append(ConfigProblem("actor_rollout_ref.model.lora_rank", "must be >= 0 (0 = full fine-tuning)", model.lora_rank))
    elif model.lora_rank > 0 and model.lora_alpha <= 0:
        p.append(ConfigProblem("actor_rollout_ref.model.lora_alpha", "must be > 0 when lora_rank > 0", model.lora_alpha))
    if model.lora_adapter_path and model.lora_rank == 0:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.model.lora_adapter_path",
                "needs actor_rollout_ref.model.lora_rank > 0 (the adapter's rank)",
                model.lora_adapter_path,
            )
        )

    # Devices requested vs present.
    counts = device_counts or available_devices()
    device = detect_device() if trainer.device == "auto" else trainer.device
    requested = trainer.n_gpus_per_node
    if trainer.nnodes == 1 and requested > counts.get(device, 0):
        what = "CPU cores (one training worker per core)" if device == "cpu" else f"{device} devices"
        p.append(
            ConfigProblem(
                "trainer.n_gpus_per_node",
                f"asks for {requested} but this machine has {counts.get(device, 0)} {what}; lower it",
                requested,
            )
        )
    if trainer.nnodes > 1 and not config.ray_kwargs.ray_init.address:
        p.append(
            ConfigProblem(
                "trainer.nnodes",
                "more than one node needs an existing Ray cluster; set ray_kwargs.ray_init.address",
                trainer.nnodes,
            )
        )

    # Ray logical CPUs: a reservation that cannot be met hangs forever (DESIGN.md section 7).
    num_cpus = config.ray_kwargs.ray_init.num_cpus
    units = config.transfer_queue.backend.SimpleStorage.num_data_storage_units
    needed = 1 + units + 1 + rollout.agent.num_workers
    if config.ray_kwargs.ray_init.address is None and num_cpus is not None and num_cpus < needed:
        p.append(
            ConfigProblem(
                "ray_kwargs.ray_init.num_cpus",
                f"too few logical CPUs: TransferQueue (1 controller + {units} storage units), the training actor (1) "
                f"and {rollout.agent.num_workers} rollout worker(s) reserve {needed}; use ray_kwargs.ray_init.num_cpus={max(16, needed)}",
                num_cpus,
            )
        )

    # Folder names that stay inside the output directory.
    for key in ("project_name", "experiment_name"):
        name = getattr(trainer, key)
        if not _SAFE_NAME.match(name) or ".." in name:
            p.append(
                ConfigProblem(
                    f"trainer.{key}",
                    "must be a plain folder name (letters, digits, '.', '_', '-'; no '/', no '..') so that "
                    "checkpoints stay inside the output directory",
                    name,
                )
            )

    # Resume.
    if trainer.resume_mode == "resume_path":
        path = trainer.resume_from_path
        if not path:
            p.append(ConfigProblem("trainer.resume_from_path", "must be set when trainer.resume_mode=resume_path", path))
        elif not Path(path).expanduser().is_dir():
            p.append(
                ConfigProblem("trainer.resume_from_path", "does not exist; point it at a global_step_N checkpoint folder", path)
            )

    # The model folder (cheap to check now, expensive to find missing after Ray started).
    model_dir = Path(model.path).expanduser()
    if not (model_dir / "model_index.json").is_file():
        p.append(
            ConfigProblem(
                "actor_rollout_ref.model.path",
                f"no diffusers pipeline at {model_dir} (model_index.json missing); point it at a pipeline folder, "
                f"or build the tiny model with `omniflow make-tiny-model {model.path}`",
                model.path,
            )
        )
    if rollout.pipeline.true_cfg_scale != 1.0:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.rollout.pipeline.true_cfg_scale",
                "true CFG (Qwen-Image style) is not implemented in OmniFlow's sampler; use "
                "actor_rollout_ref.rollout.pipeline.guidance_scale (with negative prompts for FLUX) and keep true_cfg_scale=1.0",
                rollout.pipeline.true_cfg_scale,
            )
        )

    # Prompt files (cheap to check now, expensive to find missing after Ray started).
    for key, value in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        for f in [] if value is None else [value] if isinstance(value, str) else value:
            try:
                resolve_data_path(f)
            except DataFileError as exc:
                p.append(ConfigProblem(key, str(exc), f))

    p.extend(attention_problems(config))
    return p


def validate_config(config: OmniFlowConfig, device_counts: dict[str, int] | None = None) -> None:
    """Raise one `ConfigError` listing every cross-field problem of `config`."""
    problems = config_problems(config, device_counts)
    if problems:
        raise ConfigError(problems)
