"""Files and paths: experiment names that stay inside the output folder, the resume path, the checkpoint
folder and the checkpoint to resume, the model folder and the prompt files (cheap to check now, expensive
to find missing after Ray started)."""

from __future__ import annotations

import re
from pathlib import Path

from omni_core import checkpoint as ckpt
from omni_core.checkpoint.compat import config_changes, export_only_message, has_optimizer, refusal_fix, saved_config
from omni_core.checkpoint.layout import parse_step
from omni_core.config import ConfigError, ConfigProblem, OmniFlowConfig
from omni_core.config.schema import ModelConfig
from omni_core.data_files import DataFileError, as_file_list, resolve_data_path
from omni_core.models.architectures import unsupported_pipeline_reason
from omni_core.models.hub import TRANSFORMERS_SKIP, hub_problem, is_hub_id, resolve_model_path
from omni_core.models.model_index import ModelLoadError, pipeline_class_name

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
    if not p:
        p.extend(checkpoint_folder_problems(config))
    p.extend(model_path_problems(model))
    for key, value in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        for f in as_file_list(value):
            try:
                resolve_data_path(f)
            except DataFileError as exc:
                p.append(ConfigProblem(key, str(exc), f))
    return p


def model_path_problems(model: ModelConfig) -> list[ConfigProblem]:
    """`actor_rollout_ref.model.path` (and its `revision`, `tokenizer_path`, `lora_adapter_path`): a local folder is
    checked on disk; a Hub id (`org/name` with no local folder of that name) against the Hugging Face cache, or the
    Hub when downloads are on (`hub.hub_problem`). A Hub id is never answered with `make-tiny-model`, which would
    write a random model under the real one's name."""
    key = "actor_rollout_ref.model.path"
    p: list[ConfigProblem] = []
    if is_hub_id(model.path):
        reason = hub_problem(model.path, model.revision, key)
        if reason and model.path == ModelConfig.model_fields["path"].default:  # the project's own tiny model folder
            reason += f"; it is also the default local folder of the tiny test model: `omniflow make-tiny-model {model.path}`"
        if reason:
            p.append(ConfigProblem(key, reason, model.path))
        else:  # in the cache (or downloadable): a cached snapshot's class is checked now
            try:
                cached = resolve_model_path(model.path, model.revision, download=False)
            except ModelLoadError:
                cached = None
            unsupported = _unsupported_pipeline(cached, model.architecture) if cached is not None else None
            if unsupported:
                p.append(ConfigProblem(key, f"{model.path}: {unsupported}", model.path))
    else:
        model_dir = Path(model.path).expanduser()
        unsupported = _unsupported_pipeline(model_dir, model.architecture)
        if unsupported:
            p.append(ConfigProblem(key, f"{model_dir}: {unsupported}", model.path))
        elif not (model_dir / "model_index.json").is_file():
            p.append(
                ConfigProblem(
                    key,
                    f"no diffusers pipeline at {model_dir} (model_index.json missing); point it at a pipeline folder "
                    f"or a Hugging Face Hub id (org/name), or build the tiny model there with "
                    f"`omniflow make-tiny-model {model.path}`",
                    model.path,
                )
            )
        if model.revision is not None:
            p.append(
                ConfigProblem(
                    "actor_rollout_ref.model.revision",
                    f"applies to a Hugging Face Hub id only, but {key}={model.path} is a local folder (a local folder of "
                    f"that name wins over the Hub id); remove the revision, or move the folder to load the Hub model",
                    model.revision,
                )
            )
    for name in ("tokenizer_path", "lora_adapter_path"):
        value = getattr(model, name)
        reason = hub_problem(value, None, f"actor_rollout_ref.model.{name}", skip=TRANSFORMERS_SKIP)
        if reason:
            p.append(ConfigProblem(f"actor_rollout_ref.model.{name}", reason, value))
    return p


def _unsupported_pipeline(model_dir: Path, architecture: str | None) -> str | None:
    """Why the pipeline saved in `model_dir` cannot be trained (an editing or video pipeline, a folder of another kind),
    read from its model_index.json; None when it can, or when there is no readable model_index.json (the caller's
    problem) or `model.architecture` names the class."""
    if architecture and architecture.lower() != "auto":
        return None  # the loader checks the two agree
    try:
        return unsupported_pipeline_reason(pipeline_class_name(model_dir))
    except ModelLoadError:
        return None


def _where(config: OmniFlowConfig) -> str:
    t = config.trainer
    return (
        f"the checkpoint folder {t.checkpoint_dir} (trainer.default_local_dir={t.default_local_dir}, "
        f"trainer.project_name={t.project_name}, trainer.experiment_name={t.experiment_name})"
    )


def checkpoint_folder_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    """A fresh run must not start where it would overwrite saved checkpoints (nothing saved is ever lost).

    - `resume_mode=disable` in a folder that already holds checkpoints is refused: the new run would replace
      same-numbered checkpoints of the earlier one, move `latest` backwards, and retention would then delete
      the new run's checkpoints.
    - `resume_mode=resume_path` is refused when the folder holds checkpoints newer than the resume point.
    """
    t = config.trainer
    steps = ckpt.complete_steps(t.checkpoint_dir)
    if not steps:
        return []
    if t.resume_mode == "disable":
        found = ", ".join(f"global_step_{s}" for s in sorted(steps))
        return [
            ConfigProblem(
                "trainer.resume_mode",
                f"{_where(config)} already holds checkpoints of an earlier run ({found}); a run that starts fresh there "
                f"would overwrite them. Start a new experiment (trainer.experiment_name=<new name>, or "
                f"the flow parameter new_experiment_per_run=true, as scheduled deployments set it), or continue that run with "
                f"trainer.resume_mode=auto",
                t.resume_mode,
            )
        ]
    if t.resume_mode == "resume_path":
        resume = parse_step(Path(t.resume_from_path or "").expanduser())
        newer = sorted(s for s in steps if resume is not None and s > resume)
        if newer:
            return [
                ConfigProblem(
                    "trainer.resume_from_path",
                    f"{_where(config)} holds checkpoints newer than the resume point ("
                    + ", ".join(f"global_step_{s}" for s in newer)
                    + "), which this run would overwrite. Start a new experiment (trainer.experiment_name=<new name>) "
                    "to branch from there, or resume the newest with trainer.resume_mode=auto",
                    t.resume_from_path,
                )
            ]
    return []


def resume_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    """The checkpoint a run would resume from, checked before Ray starts (read-only; `validate_resume`)."""
    return _checked_resume_point(config)[1]


def _checked_resume_point(config: OmniFlowConfig) -> tuple[str | None, list[ConfigProblem]]:
    """(the checkpoint a run would resume from or None, its problems), read-only.

    - It must match its manifest: sizes only here (one stat per file, which catches truncated and missing
      files); the run hashes every byte once when it starts (`omni_core.checkpoint.resume_point`). `auto`
      falls back to the newest checkpoint that matches, so it is a problem only when none does.
    - It must have been saved with the optimizer, under the same model / LoRA / dtype / world size
      (`omni_core.checkpoint.compat`).

    Not part of `config_problems`: its answer depends on what is saved on disk, not on the config alone, so
    the run calls it once it holds the folder's RunLock (and `_load_checkpoint` enforces it again).
    """
    t = config.trainer
    if t.resume_mode == "disable":
        return None, []
    key = "trainer.resume_from_path" if t.resume_mode == "resume_path" else "trainer.resume_mode"
    value = t.resume_from_path if t.resume_mode == "resume_path" else t.resume_mode
    try:
        path = ckpt.choose_resume(t.checkpoint_dir, t.resume_mode, t.resume_from_path, hashes=False, log_fn=lambda _: None)
    except ckpt.CheckpointError as exc:
        return None, [ConfigProblem(key, str(exc), value)]
    if path is None:
        return None, []
    if not has_optimizer(path):
        return str(path), [ConfigProblem(key, export_only_message(path), value)]
    saved = saved_config(path)
    refused = config_changes(saved, config.model_dump(mode="json"))[0] if saved is not None else []
    return str(path), [
        ConfigProblem(
            changed,
            f"differs from the checkpoint to resume, {path}, which was saved with {old!r}; {refusal_fix(changed, old)}",
            new,
        )
        for changed, old, new in refused
    ]


def validate_resume(config: OmniFlowConfig) -> str | None:
    """The checkpoint the run will resume from (None: it starts fresh); one `ConfigError` listing
    `resume_problems(config)` instead when it has any (call it before Ray starts)."""
    path, problems = _checked_resume_point(config)
    if problems:
        raise ConfigError(problems)
    return path
