"""A run's local paths made absolute in the driver, before the config goes to Ray workers.

A Ray worker starts in its raylet's working directory (and `HOME`), not the driver's: on a cluster joined by
`ray_kwargs.ray_init.address`, a relative `trainer.default_local_dir` would put the epochs' checkpoints in
another folder than the one the driver locks and resumes from, and a relative model or reward file would
not be found. So the checkpoint folder is always made absolute, and a model, adapter, checkpoint or reward
path that names an existing local file or folder is too (a hub id or a `pkg://` path is left as it is).
"""

from __future__ import annotations

from pathlib import Path

from omni_core.config.schema import OmniFlowConfig


def _absolute_if_local(path: str | None) -> str | None:
    """`path` as an absolute path when it names an existing local file or folder; unchanged otherwise."""
    if not path or "://" in path:
        return path
    local = Path(path).expanduser()
    return str(local.resolve()) if local.exists() else path


def with_absolute_paths(config: OmniFlowConfig) -> OmniFlowConfig:
    trainer = config.trainer.model_copy(
        update={
            "default_local_dir": str(config.trainer.checkpoint_dir.resolve()),
            "resume_from_path": _absolute_if_local(config.trainer.resume_from_path),
        }
    )
    model = config.actor_rollout_ref.model
    model = model.model_copy(
        update={key: _absolute_if_local(getattr(model, key)) for key in ("path", "tokenizer_path", "lora_adapter_path")}
    )
    reward = config.reward
    custom = reward.custom_reward_function.model_copy(update={"path": _absolute_if_local(reward.custom_reward_function.path)})
    local_keys = ("path", "model_path", "processor_path", "head_path")  # reward files; model rewards' folders and head
    functions = tuple(
        f.model_copy(update={k: _absolute_if_local(getattr(f, k)) for k in local_keys}) for f in reward.reward_functions
    )
    return config.model_copy(
        update={
            "trainer": trainer,
            "actor_rollout_ref": config.actor_rollout_ref.model_copy(update={"model": model}),
            "reward": reward.model_copy(update={"custom_reward_function": custom, "reward_functions": functions}),
        }
    )
