"""Loading a config: defaults, YAML file(s) and overrides (composed by `compose`) -> a validated, immutable config.

`compose` merges the layers with OmegaConf and resolves `${...}`; this module checks the plain tree against
the schema. Unknown keys, unsupported verl-omni keys or values and wrong types are all collected into one
`ConfigError` that names every key path (with the nearest valid key for typos).
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from omni_core.config.compose import Composed, compose, without_keys, yaml_layers
from omni_core.config.defaults_file import flatten, load_defaults
from omni_core.config.errors import ConfigError, ConfigProblem
from omni_core.config.schema import OmniFlowConfig, RewardFunctionSpec
from omni_core.config.unsupported import UNKNOWN_IN_SECTION, UNSUPPORTED_VALUES, reward_model_refusal, unsupported_key_reason

# Said of a key added with `+` that the schema has no place for (verl adds keys its defaults lack; OmniFlow's
# schema names every key it honours, so a new key is taken only inside a free mapping).
PLUS_NOTE = (
    " (`+` adds a key to the config, but OmniFlow's schema has no such key: new keys go only inside free mappings, "
    "e.g. +ray_kwargs.ray_init.runtime_env.env_vars.NAME=value)"
)


def set_path(tree: dict[str, Any], path: str, value: Any) -> None:
    """Set `tree[a][b][c] = value` for path `a.b.c`, creating sections as needed (a plain dict, no parsing)."""
    node = tree
    parts = path.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


# ----------------------------------------------------------------------------------- key checks
def config_keys(cls: type[BaseModel]) -> dict[str, Any]:
    """The keys a section takes as a user writes them (a field's alias, e.g. ray_init's `_temp_dir`) -> field info."""
    return {info.alias or name: info for name, info in cls.model_fields.items()}


def _all_paths(cls: type[BaseModel] = OmniFlowConfig, prefix: str = "") -> list[str]:
    paths = []
    for name, info in config_keys(cls).items():
        path = f"{prefix}{name}"
        paths.append(path)
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            paths.extend(_all_paths(ann, f"{path}."))
    return paths


def _suggest(path: str, siblings: Iterable[str]) -> str:
    prefix, _, leaf = path.rpartition(".")
    close = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.6)
    if close:
        return f"unknown key; did you mean {prefix + '.' if prefix else ''}{close[0]}?"
    # The same name elsewhere in the tree (e.g. `trainer.lr` for actor_rollout_ref.actor.optim.lr).
    elsewhere = [p for p in _all_paths() if p.rsplit(".", 1)[-1] == leaf]
    if elsewhere:
        return f"unknown key; did you mean {' or '.join(elsewhere[:3])}?"
    close = difflib.get_close_matches(path, _all_paths(), n=1, cutoff=0.75)
    if close:
        return f"unknown key; did you mean {close[0]}?"
    valid = ", ".join(sorted(siblings))
    return f"unknown key; valid keys here: {valid}"


def check_keys(data: Mapping[str, Any], cls: type[BaseModel] = OmniFlowConfig, prefix: str = "") -> list[ConfigProblem]:
    """Problems for unknown / unsupported keys and unsupported values, before pydantic sees the data."""
    problems: list[ConfigProblem] = []
    fields = config_keys(cls)
    for key, value in data.items():
        path = f"{prefix}{key}"
        reason = reward_model_refusal(value) if path == "reward.reward_model" else unsupported_key_reason(path)
        if reason:
            problems.append(ConfigProblem(path, f"not supported by OmniFlow: {reason}"))
            continue
        if key not in fields:
            section_reason = UNKNOWN_IN_SECTION.get(prefix.rstrip("."))
            if section_reason:
                accepted = ", ".join(fields)
                problems.append(ConfigProblem(path, f"not supported by OmniFlow: {section_reason.format(accepted=accepted)}"))
            else:
                problems.append(ConfigProblem(path, _suggest(path, fields)))
            continue
        if path == "reward.reward_functions":
            continue  # each entry's keys, by its kind: validation (omni_core.validation.reward_terms), once
        ann = fields[key].annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel) and ann is not RewardFunctionSpec:
            if isinstance(value, Mapping):
                problems.extend(check_keys(value, ann, f"{path}."))
            elif value is not None:
                problems.append(ConfigProblem(path, "is a section; set its keys (e.g. path.key=value)", value))
            continue
        bad_values = UNSUPPORTED_VALUES.get(path, {})
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, str) and item in bad_values:
                problems.append(ConfigProblem(path, f"not supported by OmniFlow: {bad_values[item]}", value))
    return problems


def _pydantic_problems(exc: ValidationError) -> list[ConfigProblem]:
    problems = []
    for err in exc.errors():
        problems.append(ConfigProblem(_key_path(err["loc"]), err["msg"], err.get("input")))
    # One problem per key: union types report each failed branch.
    unique: dict[str, ConfigProblem] = {}
    for p in problems:
        unique.setdefault(p.key, p)
    return list(unique.values())


def _key_path(loc: tuple[Any, ...]) -> str:
    """The config key path of a pydantic error location (union-branch and list-index parts dropped)."""
    parts: list[str] = []
    cls: Any = OmniFlowConfig
    for part in loc:
        fields = config_keys(cls) if isinstance(cls, type) and issubclass(cls, BaseModel) else {}
        if part in fields:
            parts.append(str(part))
            cls = fields[part].annotation
        elif isinstance(part, int):
            parts.append(str(part))
    return ".".join(parts)


def fold_model_pipeline(data: Mapping[str, Any]) -> tuple[dict[str, Any], list[ConfigProblem]]:
    """verl-omni's `actor_rollout_ref.model.pipeline.*`: the pipeline settings of its training adapter, which default to
    `rollout.pipeline.*` (`oc.select`). OmniFlow trains and samples with one set, `rollout.pipeline`: with offline samples
    (no rollout; verl-omni's offline DPO recipe sets `model.pipeline.guidance_scale`) the model's values are that set;
    online, a value that differs from the rollout's is refused (its training forward would differ from its sampling)."""
    tree = copy.deepcopy(dict(data))
    model = tree.get("actor_rollout_ref", {}).get("model", {})
    if not isinstance(model, dict) or "pipeline" not in model:
        return tree, []
    given = model.pop("pipeline")
    if not isinstance(given, dict):
        return tree, [ConfigProblem("actor_rollout_ref.model.pipeline", "must be a mapping of pipeline settings", given)]
    rollout = tree["actor_rollout_ref"].setdefault("rollout", {}).setdefault("pipeline", {})
    offline = tree.get("algorithm", {}).get("sample_source") == "offline"
    problems = []
    for name, value in given.items():
        key = f"actor_rollout_ref.model.pipeline.{name}"
        if name not in rollout:
            problems.append(ConfigProblem(key, f"unknown key; OmniFlow's pipeline settings are actor_rollout_ref.rollout.pipeline.{{{', '.join(rollout)}}}", value))
        elif offline:
            rollout[name] = value
        elif value != rollout[name]:
            problems.append(
                ConfigProblem(
                    key,
                    f"OmniFlow's training forward uses the rollout's pipeline settings, and actor_rollout_ref.rollout.pipeline."
                    f"{name}={rollout[name]}: set that key instead (one value for both)",
                    value,
                )
            )
    return tree, problems


# ---------------------------------------------------------------------------------------- entry
def config_and_problems(data: Mapping[str, Any]) -> tuple[OmniFlowConfig | None, list[ConfigProblem]]:
    """Every key / value / type problem of a nested dict, and the config of what is left.

    The config is built without the keys that have a problem (their defaults stand in), so that the
    cross-field rules can check the rest in the same round (`omni_core.validation.prepare_run_config`);
    None when even that does not validate.
    """
    data, folded = fold_model_pipeline(data)
    problems = [*folded, *check_keys(data)]
    clean = without_keys(data, {p.key for p in problems})
    for _ in range(3):  # each round drops the keys pydantic refused (defaults stand in); one or two rounds end it
        try:
            return OmniFlowConfig.model_validate(clean), problems
        except ValidationError as exc:
            found = [p for p in _pydantic_problems(exc) if p.key not in {q.key for q in problems}]
            if not found:
                break
            problems.extend(found)
            clean = without_keys(clean, {p.key for p in found})
    return None, problems


def config_from_dict(data: Mapping[str, Any]) -> OmniFlowConfig:
    """Validate a nested dict into an `OmniFlowConfig`; all problems raised together."""
    config, problems = config_and_problems(data)
    if problems or config is None:
        raise ConfigError(problems)
    return config


def load_config(files: str | Path | Sequence[str | Path] | None = None, overrides: Sequence[str] = ()) -> OmniFlowConfig:
    """`defaults.yaml`, then YAML file(s) (later ones win), then overrides (`key.path=value`, `+key=value`,
    `~key`), with `${...}` resolved (see `compose`) -> a validated config."""
    config, problems = load_config_and_problems(files, overrides)
    if problems or config is None:
        raise ConfigError(problems)
    return config


def load_config_and_problems(
    files: str | Path | Sequence[str | Path] | None = None, overrides: Sequence[str] = ()
) -> tuple[OmniFlowConfig | None, list[ConfigProblem]]:
    """`load_config` that returns its problems instead of raising them, with the config of the keys that
    have none (see `config_and_problems`); a file that cannot be read is still raised at once."""
    if files is None:
        files = []
    elif isinstance(files, (str, Path)):
        files = [files]
    layers = [layer for f in files for layer in yaml_layers(f)]
    return _validated(compose(copy.deepcopy(load_defaults()[0]), layers, overrides))


def _validated(composed: Composed) -> tuple[OmniFlowConfig | None, list[ConfigProblem]]:
    """The composed tree validated; a key added with `+` where the schema takes none says so."""
    config, more = config_and_problems(composed.tree)
    more = [ConfigProblem(p.key, p.message + PLUS_NOTE, p.value) if _added_unknown(p, composed.added) else p for p in more]
    return config, [*composed.problems, *more]


def _added_unknown(problem: ConfigProblem, added: set[str]) -> bool:
    """Whether `problem` is an unknown key that a `+key=value` override added (or added a key below)."""
    named = any(key == problem.key or key.startswith(f"{problem.key}.") for key in added)
    return named and problem.message.startswith("unknown key")


def with_updates(config: OmniFlowConfig, updates: Mapping[str, Any]) -> OmniFlowConfig:
    """A copy of `config` with dotted-path updates applied and validated again."""
    tree = config.model_dump(mode="python")
    for key, value in updates.items():
        set_path(tree, key, value)
    return config_from_dict(tree)


def resolve_config(
    config: OmniFlowConfig | None, overrides: Sequence[str] = (), files: Sequence[str | Path] = ()
) -> OmniFlowConfig:
    """A config given as an object (a flow parameter), or else the defaults and YAML `files`, with
    `key.path=value` overrides on top."""
    resolved, problems = resolve_config_and_problems(config, overrides, files)
    if problems or resolved is None:
        raise ConfigError(problems)
    return resolved


def resolve_config_and_problems(
    config: OmniFlowConfig | None, overrides: Sequence[str] = (), files: Sequence[str | Path] = ()
) -> tuple[OmniFlowConfig | None, list[ConfigProblem]]:
    """`resolve_config` that returns its problems with the config of the keys that have none."""
    if config is None:
        return load_config_and_problems(files, overrides)
    if not overrides:
        return config, []
    return _validated(compose(config.model_dump(mode="python"), [], overrides))


def with_experiment_suffix(config: OmniFlowConfig, suffix: str) -> OmniFlowConfig:
    """`trainer.experiment_name` + `-<suffix>`, and an explicit `default_local_dir` gets a subfolder of that
    name: a scheduled run trains a new experiment instead of resuming an earlier one."""
    t = config.trainer
    name = f"{t.experiment_name}-{suffix}"
    updates: dict[str, Any] = {"trainer.experiment_name": name}
    if t.default_local_dir:
        updates["trainer.default_local_dir"] = str(Path(t.default_local_dir) / name)
    return with_updates(config, updates)


def to_yaml(config: OmniFlowConfig) -> str:
    """The resolved config as YAML (block style, schema order)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, default_flow_style=False)


def to_flat_dict(config: OmniFlowConfig) -> dict[str, Any]:
    """{dotted.key: value} of the resolved config (for tracking backends and artifacts)."""
    return flatten(config.model_dump(mode="json"))
