"""Files and paths: experiment names that stay inside the output folder, the resume path, the model
folder and the prompt files (cheap to check now, expensive to find missing after Ray started)."""

from __future__ import annotations

import re
from pathlib import Path

from omni_core.config import ConfigProblem, OmniFlowConfig
from omni_core.data_files import DataFileError, as_file_list, resolve_data_path

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def path_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    p: list[ConfigProblem] = []
    trainer, data, model = config.trainer, config.data, config.actor_rollout_ref.model
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
    if trainer.resume_mode == "resume_path":
        path = trainer.resume_from_path
        if not path:
            p.append(ConfigProblem("trainer.resume_from_path", "must be set when trainer.resume_mode=resume_path", path))
        elif not Path(path).expanduser().is_dir():
            p.append(
                ConfigProblem("trainer.resume_from_path", "does not exist; point it at a global_step_N checkpoint folder", path)
            )
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
    for key, value in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        for f in as_file_list(value):
            try:
                resolve_data_path(f)
            except DataFileError as exc:
                p.append(ConfigProblem(key, str(exc), f))
    return p
