"""Cross-field config rules, checked before any Ray or TransferQueue process starts.

verl-omni's `main()` runs `auto_set_device`, `validate_config` and `validate_attention_consistency`
on the config; `prepare_run_config` does the same here (and resolves the config, names a per-run
experiment, and forces the TransferQueue on, as verl-omni's v1 runner does). verl-omni scatters its
rules over dataclass `__post_init__`s and trainer asserts; OmniFlow checks them all up front and
reports every problem of a config together, each with its key path, the value given and a fix.

The rules live in one module per group, found by name:

  batch_sizes     data.train_batch_size, mini / micro batches, samples per prompt
  rollout         the SDE window inside the denoising steps, CFG, rollout log-probs for bypass mode
  algorithm       advantage estimator, loss mode, LoRA keys
  trainer_modes   the v1 trainer, registered modes, separate_async's requirements
  devices         devices requested vs present, nodes, the run's Ray logical-CPU budget
  paths           experiment names, the resume path, the model folder, prompt files
  rewards         built-in reward names and reward files
  tracking        trainer.logger backends and the packages they need
  attention       the actor / rollout attention-backend pair

Light on purpose: this package imports neither diffusers, transformers nor Ray, and torch only to
probe a machine that shows an accelerator driver, so `omniflow validate` answers in about a second.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omni_core.config import ConfigError, ConfigProblem, OmniFlowConfig, resolve_config, with_experiment_suffix, with_updates
from omni_core.validation.algorithm import algorithm_problems
from omni_core.validation.attention import attention_problems, validate_attention_consistency
from omni_core.validation.batch_sizes import batch_size_problems
from omni_core.validation.devices import device_problems
from omni_core.validation.paths import path_problems
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


def config_problems(config: OmniFlowConfig, device_counts: dict[str, int] | None = None) -> list[ConfigProblem]:
    """Every cross-field problem of `config` (empty when it is valid), group by group."""
    return [
        *trainer_mode_problems(config),
        *batch_size_problems(config),
        *rollout_problems(config),
        *algorithm_problems(config),
        *device_problems(config, device_counts),
        *path_problems(config),
        *reward_problems(config),
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
) -> OmniFlowConfig:
    """The checked config of one run, as verl-omni's `main()` prepares it.

    `config` (a flow parameter) or else the defaults and `config_files`, with `overrides` on top;
    `trainer.device` resolved (`auto_set_device`); with `experiment_suffix`, a per-run experiment
    (`<experiment_name>-<suffix>`); the TransferQueue forced on (the v1 trainer needs it, as in
    verl-omni's `run_diffusion_v1`); then every rule, with all problems in one `ConfigError`.
    """
    from omni_core.device import auto_set_device

    cfg = auto_set_device(resolve_config(config, overrides, config_files))
    if experiment_suffix:
        cfg = with_experiment_suffix(cfg, experiment_suffix)
    cfg = with_updates(cfg, {"transfer_queue.enable": True})
    validate_config(cfg)
    return cfg
