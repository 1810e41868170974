"""Cross-field config rules, checked before any Ray or TransferQueue process starts.

verl-omni's `main()` runs `auto_set_device`, `validate_config` and `validate_attention_consistency`
on the config; `prepare_run_config` does the same here (and resolves the config and names a per-run
experiment). verl-omni scatters its rules over dataclass `__post_init__`s and trainer asserts; OmniFlow
checks them all up front and reports every problem of a config together (unknown and refused keys,
wrong types and cross-field rules in one error), each with its key path, the value given and a fix.

The rules live in one module per group, found by name:

  refused         keys at their only implemented value (REFUSED_WHEN_NOT_DEFAULT), with the reason
  batch_sizes     data.train_batch_size, mini / micro / generation batches, samples per prompt
  rollout         the SDE window inside the denoising steps, rollout log-probs for bypass mode
  guidance        guidance_scale / true_cfg_scale as the model's architecture defines them
  image_size      rollout.pipeline.height / width against the model's VAE, patch and position table
  algorithm       advantage estimator, loss mode, LoRA keys
  direct_preference  DiffusionNFT's keys and what it cannot be combined with; pairs (DPO)
  offline_samples offline Diffusion-DPO's pairs data set (sample_source=offline) and data.custom_cls
  distillation    the teacher switch with a loss that reads it, the teacher pipeline and its noise grid
  precision       actor.fsdp_config.model_dtype below fp32 only under LoRA
  trainer_modes   registered modes, separate_async's requirements
  devices         devices requested vs present, the ray.init arguments, the run's Ray CPU / GPU budget
  paths           experiment names, the resume path, the model folder, prompt files
  data_files      prompt-file contents (UTF-8, JSON rows, a parquet footer with the prompt column)
  rewards         built-in reward names and reward files (parsed, never executed)
  tracking        trainer.logger backends and the packages they need
  attention       the actor / rollout attention-backend pair

Light on purpose: this package imports neither diffusers, transformers nor Ray, and torch only to
probe a machine that shows an accelerator driver, so `omniflow validate` answers in about a second.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omni_core.config import ConfigError, ConfigProblem, OmniFlowConfig, resolve_config_and_problems, with_experiment_suffix
from omni_core.validation.algorithm import algorithm_problems
from omni_core.validation.attention import attention_problems, validate_attention_consistency
from omni_core.validation.batch_sizes import batch_size_problems
from omni_core.validation.data_files import data_file_problems
from omni_core.validation.devices import device_problems
from omni_core.validation.direct_preference import direct_preference_problems
from omni_core.validation.distillation import distillation_problems
from omni_core.validation.guidance import guidance_problems
from omni_core.validation.image_size import image_size_problems
from omni_core.validation.offline_samples import offline_sample_problems
from omni_core.validation.paths import path_problems
from omni_core.validation.precision import precision_problems
from omni_core.validation.refused import refused_value_problems
from omni_core.validation.rewards import reward_problems
from omni_core.validation.rollout import rollout_problems
from omni_core.validation.tracking import tracking_problems
from omni_core.validation.trainer_modes import trainer_mode_problems

__all__ = [
    "attention_problems",
    "config_problems",
    "prepare_run_config",
    "validate_attention_consistency",
    "validate_config",
]


def config_problems(
    config: OmniFlowConfig,
    device_counts: dict[str, int] | None = None,
    allowed_reward_dirs: Sequence[str | Path] | None = None,
) -> list[ConfigProblem]:
    """Every cross-field problem of `config` (empty when it is valid), group by group; `allowed_reward_dirs`:
    see `prepare_run_config`."""
    return [
        *refused_value_problems(config),
        *trainer_mode_problems(config),
        *batch_size_problems(config),
        *rollout_problems(config),
        *guidance_problems(config),
        *image_size_problems(config),
        *algorithm_problems(config),
        *direct_preference_problems(config),
        *offline_sample_problems(config),
        *distillation_problems(config),
        *precision_problems(config),
        *device_problems(config, device_counts),
        *path_problems(config),
        *data_file_problems(config),
        *reward_problems(config, allowed_reward_dirs),
        *tracking_problems(config),
        *attention_problems(config),
    ]


def validate_config(config: OmniFlowConfig, device_counts: dict[str, int] | None = None) -> None:
    """Raise one `ConfigError` listing every cross-field problem of `config`."""
    problems = config_problems(config, device_counts)
    if problems:
        raise ConfigError(problems)


def prepare_run_config(
    config: OmniFlowConfig | None,
    overrides: Sequence[str] = (),
    config_files: Sequence[str | Path] = (),
    experiment_suffix: str | None = None,
    allowed_reward_dirs: Sequence[str | Path] | None = None,
) -> OmniFlowConfig:
    """The checked config of one run, as verl-omni's `main()` prepares it.

    `config` (a flow parameter) or else the defaults and `config_files`, with `overrides` on top;
    `trainer.device` resolved (`auto_set_device`); with `experiment_suffix`, a per-run experiment
    (`<experiment_name>-<suffix>`); then every rule. With `allowed_reward_dirs` (a run started through a
    deployment), reward files must lie inside those folders (`rewards.deployment_reward_dirs`); None
    accepts any path. All problems come in one `ConfigError`: the
    cross-field rules also run when some keys are unknown, refused or mistyped (on the config of the
    other keys, defaults standing in), minus any rule that names a key already reported.
    """
    from omni_core.config.absolute_paths import with_absolute_paths
    from omni_core.device import auto_set_device

    cfg, problems = resolve_config_and_problems(config, overrides, config_files)
    if cfg is not None:
        try:
            cfg = auto_set_device(cfg)
        except ConfigError as exc:  # an explicit device that is absent: check the rest on the detected one
            problems.extend(exc.problems)
            cfg = auto_set_device(cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"device": "auto"})}))
        if experiment_suffix:
            cfg = with_experiment_suffix(cfg, experiment_suffix)
        cfg = with_absolute_paths(cfg)  # Ray workers on other nodes start in other folders
        reported = {p.key for p in problems}
        problems.extend(p for p in config_problems(cfg, allowed_reward_dirs=allowed_reward_dirs) if p.key not in reported)
    if problems or cfg is None:
        raise ConfigError(problems)
    return cfg
