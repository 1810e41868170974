"""Loading a config: YAML file(s) + `key.path=value` overrides -> a validated, immutable config.

Overrides are typed the way a verl / Hydra user expects: `1e-4` is a float (PyYAML would read a
string), `true` / `false` / `null` are literals, `[a,b]` is a list and quotes keep a string.
Unknown keys, unsupported verl-omni keys or values and wrong types are all collected into one
`ConfigError` that names every key path (with the nearest valid key for typos).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from omni_core.config.defaults_file import flatten
from omni_core.config.errors import ConfigError, ConfigProblem
from omni_core.config.schema import OmniFlowConfig, RewardFunctionSpec
from omni_core.config.unsupported import UNKNOWN_IN_SECTION, UNSUPPORTED_VALUES, reward_model_refusal, unsupported_key_reason

_INT = re.compile(r"^[-+]?\d+$")
_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^[-+]?(inf|nan)$", re.IGNORECASE)


# ------------------------------------------------------------------------------ override parsing
def parse_value(text: str) -> Any:
    """Parse one override value: int, float (incl. 1e-4), bool, null, [list], {mapping} or string."""
    s = text.strip()
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
        return s[1:-1]
    low = s.lower()
    if low in ("null", "none", "~"):
        return None
    if low in ("true", "false"):
        return low == "true"
    if _INT.match(s):
        return int(s)
    if _FLOAT.match(s):
        return float(s)
    if s.startswith("[") and s.endswith("]"):
        inner = s[1:-1].strip()
        return [parse_value(item) for item in _split_top_level(inner)] if inner else []
    if s.startswith("{") and s.endswith("}"):
        loaded = yaml.safe_load(s)
        return _retype_floats(loaded)
    return s


def _split_top_level(s: str) -> list[str]:
    """Split on commas that are not inside brackets or quotes."""
    items, depth, quote, current = [], 0, "", []
    for ch in s:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append("".join(current))
            current = []
            continue
        current.append(ch)
    items.append("".join(current))
    return items


def _retype_floats(value: Any) -> Any:
    """PyYAML reads `1e-4` as a string; read such strings as floats, everywhere in a loaded tree."""
    if isinstance(value, str) and _FLOAT.match(value.strip()) and not _INT.match(value.strip()):
        return float(value)
    if isinstance(value, dict):
        return {k: _retype_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_retype_floats(v) for v in value]
    return value


def parse_override(arg: str) -> tuple[str, Any]:
    """`key.path=value` (a leading `+` as in Hydra is accepted) -> (key path, typed value)."""
    if "=" not in arg:
        raise ConfigError([ConfigProblem(arg, "an override must look like key.path=value, e.g. data.train_batch_size=8")])
    key, _, raw = arg.partition("=")
    key = key.strip().lstrip("+")
    if not key or not all(part.isidentifier() for part in key.split(".")):
        raise ConfigError([ConfigProblem(key or arg, "not a valid key path; write dotted names like trainer.total_epochs=3")])
    return key, parse_value(raw)


def set_path(tree: dict[str, Any], path: str, value: Any) -> None:
    """Set `tree[a][b][c] = value` for path `a.b.c`, creating sections as needed."""
    node = tree
    parts = path.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Merge `update` into a copy of `base`; sections merge, leaves replace."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def read_yaml_file(path: str | Path) -> dict[str, Any]:
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError([ConfigProblem(str(path), "config file not found; pass an existing YAML file")])
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError([ConfigProblem(str(path), f"not valid YAML: {exc}")]) from exc
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError([ConfigProblem(str(path), "a config file must hold a mapping of sections (data:, trainer:, ...)")])
    return _retype_floats(loaded)


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


# ---------------------------------------------------------------------------------------- entry
def config_and_problems(data: Mapping[str, Any]) -> tuple[OmniFlowConfig | None, list[ConfigProblem]]:
    """Every key / value / type problem of a nested dict, and the config of what is left.

    The config is built without the keys that have a problem (their defaults stand in), so that the
    cross-field rules can check the rest in the same round (`omni_core.validation.prepare_run_config`);
    None when even that does not validate.
    """
    problems = check_keys(data)
    clean = _without_keys(data, {p.key for p in problems})
    for _ in range(3):  # each round drops the keys pydantic refused (defaults stand in); one or two rounds end it
        try:
            return OmniFlowConfig.model_validate(clean), problems
        except ValidationError as exc:
            found = [p for p in _pydantic_problems(exc) if p.key not in {q.key for q in problems}]
            if not found:
                break
            problems.extend(found)
            clean = _without_keys(clean, {p.key for p in found})
    return None, problems


def config_from_dict(data: Mapping[str, Any]) -> OmniFlowConfig:
    """Validate a nested dict into an `OmniFlowConfig`; all problems raised together."""
    config, problems = config_and_problems(data)
    if problems or config is None:
        raise ConfigError(problems)
    return config


def _without_keys(data: Mapping[str, Any], paths: set[str]) -> dict[str, Any]:
    """A copy of `data` without `paths`; a path that runs into a list (`reward.reward_functions.0.x`) drops
    the deepest mapping key it names (`reward.reward_functions`)."""
    out = _copy_tree(data)
    for path in paths:
        node: Any = out
        parts = path.split(".")
        for i, part in enumerate(parts):
            if not isinstance(node, dict) or part not in node:
                break
            if i == len(parts) - 1 or not isinstance(node[part], dict):
                del node[part]
                break
            node = node[part]
    return out


def _copy_tree(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _copy_tree(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def load_config(files: str | Path | Sequence[str | Path] | None = None, overrides: Sequence[str] = ()) -> OmniFlowConfig:
    """YAML file(s) (later ones win) + `key.path=value` overrides -> a validated config.

    The defaults in `defaults.yaml` fill every key that neither sets.
    """
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
    tree: dict[str, Any] = {}
    for f in files:
        tree = deep_merge(tree, read_yaml_file(f))
    problems: list[ConfigProblem] = []
    for arg in overrides:
        try:
            key, value = parse_override(arg)
        except ConfigError as exc:
            problems.extend(exc.problems)
            continue
        set_path(tree, key, value)
    config, more = config_and_problems(tree)
    return config, [*problems, *more]


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
    tree = config.model_dump(mode="python")
    problems: list[ConfigProblem] = []
    for arg in overrides:
        try:
            key, value = parse_override(arg)
        except ConfigError as exc:
            problems.extend(exc.problems)
            continue
        set_path(tree, key, value)
    resolved, more = config_and_problems(tree)
    return resolved, [*problems, *more]


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
