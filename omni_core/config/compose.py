"""Composing a config tree with OmegaConf, as verl / Hydra does: defaults, YAML files, overrides, interpolation.

The layers merge in this order: the packaged `defaults.yaml`, each YAML file (a file's `defaults:` list of
sibling files first, as Hydra composes it), then the command line's overrides:

  key.path=value    set a key (values typed as a verl user types them, see `parse_value`)
  +key.path=value   Hydra's add-a-key; the schema decides where a new key may go (`loader.check_keys`)
  ++key.path=value  Hydra's add-or-set
  ~key.path         delete a key (its schema default stands in); `~key.path=value` only when it holds value

Then `${...}` interpolations (`${actor_rollout_ref.rollout.n}`, `${oc.select:key,default}`, `${oc.env:VAR}`)
are resolved, so the pydantic schema sees plain values. Every problem names its key and what to fix; a key
with a problem is dropped from the tree (its default stands in), so one round reports them all.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from omni_core.config.errors import ConfigError, ConfigProblem

_INT = re.compile(r"^[-+]?\d+$")
_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^[-+]?(inf|nan)$", re.IGNORECASE)
_UNSET = object()
# A `defaults:` entry that places the file's own keys (Hydra); without one they come last, as in Hydra 1.1+.
SELF = "_self_"


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


@dataclass(frozen=True)
class Override:
    """One command-line override: `op` is "set" (`key=v`, `++key=v`), "add" (`+key=v`) or "delete" (`~key`)."""

    key: str
    value: Any = None
    op: str = "set"
    has_value: bool = True


def parse_override(arg: str) -> Override:
    """`key.path=value`, `+key.path=value`, `++key.path=value`, `~key.path[=value]` -> an `Override`."""
    delete = arg.startswith("~")
    if "=" not in arg and not delete:
        raise ConfigError([ConfigProblem(arg, "an override must look like key.path=value, e.g. data.train_batch_size=8")])
    key, eq, raw = arg.partition("=")
    key = key.strip()
    op = "delete" if delete else "add" if key.startswith("+") and not key.startswith("++") else "set"
    key = key.lstrip("~+")
    # A list index is a part too: reward.reward_functions.0.weight=2.
    if not key or not all(part.isidentifier() or part.isdigit() for part in key.split(".")):
        raise ConfigError([ConfigProblem(key or arg, "not a valid key path; write dotted names like trainer.total_epochs=3")])
    return Override(key, parse_value(raw) if eq else None, op, bool(eq))


# ---------------------------------------------------------------------------------- YAML files
def config_name_file(config_path: str | Path | None, config_name: str) -> Path:
    """verl's `--config-path=DIR --config-name=NAME` -> DIR/NAME.yaml (the `.yaml` may be given)."""
    folder = Path(config_path or ".").expanduser()
    path = folder / (config_name if config_name.endswith((".yaml", ".yml")) else f"{config_name}.yaml")
    if not path.is_file():
        found = ", ".join(sorted(p.stem for p in folder.glob("*.yaml"))) or "none"
        raise ConfigError([ConfigProblem("--config-name", f"no file {path}; YAML files in {folder}: {found}", config_name)])
    return path


def read_yaml_file(path: str | Path) -> dict[str, Any]:
    """One YAML file as a mapping (its `defaults:` list still in it); floats like 1e-4 typed as floats."""
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


def yaml_layers(path: str | Path, _seen: tuple[Path, ...] = ()) -> list[dict[str, Any]]:
    """The mappings one YAML file contributes, in merge order: the files of its `defaults:` list (names of YAML
    files beside it, each with its own list) and its own keys where `_self_` stands (last when absent)."""
    path = Path(path).expanduser()
    data = read_yaml_file(path)
    entries = data.pop("defaults", [])
    if not isinstance(entries, list):
        raise ConfigError([ConfigProblem(f"{path}: defaults", "must be a list of YAML file names beside this file")])
    if SELF not in entries:
        entries = [*entries, SELF]
    layers: list[dict[str, Any]] = []
    for entry in entries:
        if entry == SELF:
            layers.append(data)
            continue
        if not isinstance(entry, str):
            raise ConfigError(
                [
                    ConfigProblem(
                        f"{path}: defaults",
                        "Hydra config groups (group: option, override ..., optional ...) are not supported; list the "
                        "names of YAML files beside this one (e.g. - base) and _self_",
                        entry,
                    )
                ]
            )
        sibling = path.parent / (entry if entry.endswith((".yaml", ".yml")) else f"{entry}.yaml")
        if not sibling.is_file():
            raise ConfigError(
                [
                    ConfigProblem(
                        f"{path}: defaults",
                        f"no file {sibling}; list YAML files beside this one. OmniFlow's own defaults.yaml is always "
                        "loaded first, so a verl base config (e.g. diffusion_trainer) need not be listed",
                        entry,
                    )
                ]
            )
        if sibling.resolve() in _seen:
            raise ConfigError(
                [ConfigProblem(f"{path}: defaults", f"{sibling} lists itself through its defaults (a cycle)", entry)]
            )
        layers.extend(yaml_layers(sibling, (*_seen, path.resolve())))
    return layers


# ------------------------------------------------------------------------------------ composing
@dataclass
class Composed:
    """The merged, resolved tree; the problems found on the way; the keys added with `+`."""

    tree: dict[str, Any]
    problems: list[ConfigProblem]
    added: set[str]


def compose(base: Mapping[str, Any], layers: Sequence[Mapping[str, Any]], overrides: Sequence[str]) -> Composed:
    """`base`, then each layer merged on top (sections merge, leaves and lists replace), then `overrides`, then
    the interpolations resolved (`OmegaConf.to_container(resolve=True)`)."""
    problems: list[ConfigProblem] = []
    cfg = OmegaConf.create(_checked_strings(base, problems))
    for layer in layers:
        layer = _checked_strings(layer, problems)
        _clear_kind_changes(cfg, layer)
        try:
            cfg = OmegaConf.merge(cfg, layer)
        except OmegaConfBaseException as exc:  # e.g. a YAML date, which no config key takes
            key = str(getattr(exc, "full_key", "") or "config")
            problems.append(ConfigProblem(key, f"cannot be merged: {_first_line(exc)}; write a string, number or list"))
    added: set[str] = set()
    for arg in overrides:
        try:
            override = parse_override(arg)
        except ConfigError as exc:
            problems.extend(exc.problems)
            continue
        if override.op == "add":
            added.add(override.key)
        problem = _apply(cfg, override)
        if problem:
            problems.append(problem)
    return Composed(_resolved(cfg, problems), problems, added)


def _checked_strings(tree: Mapping[str, Any], problems: list[ConfigProblem]) -> dict[str, Any]:
    """`tree` without the strings whose `${...}` does not parse (each a problem naming its key)."""
    broken = []
    for path, value in _leaves(tree):
        if isinstance(value, str) and "${" in value:
            try:
                OmegaConf.create({"value": value})
            except OmegaConfBaseException as exc:
                problems.append(_interpolation_problem(path, value, exc))
                broken.append(path)
    return without_keys(tree, set(broken))


def _clear_kind_changes(cfg: DictConfig, layer: Mapping[str, Any]) -> None:
    """Where a layer puts a mapping over a list or a list over a mapping (verl's `reward_functions: {label: ...}`
    over the default `[]`), the layer's value replaces the old one instead of failing to merge with it."""
    for key, value in layer.items():
        if key not in cfg:
            continue
        node = cfg._get_node(key)
        if isinstance(value, Mapping) and isinstance(node, DictConfig):
            _clear_kind_changes(node, value)
        elif isinstance(value, (Mapping, list)) and isinstance(node, (DictConfig, ListConfig)):
            cfg[key] = None


def _apply(cfg: DictConfig, override: Override) -> ConfigProblem | None:
    if override.op == "delete":
        current = OmegaConf.select(cfg, override.key, default=_UNSET, throw_on_resolution_failure=False)
        if current is _UNSET:
            return ConfigProblem(f"~{override.key}", "deletes a key, but the config has no such key; check the key path")
        if override.has_value and _plain(current) != override.value:
            return ConfigProblem(
                f"~{override.key}",
                f"deletes the key only while it holds {override.value!r}, and it holds {_plain(current)!r}; "
                f"write ~{override.key} to delete it whatever it holds",
            )
        parent_key, _, leaf = override.key.rpartition(".")
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
        del parent[int(leaf) if isinstance(parent, ListConfig) else leaf]
        return None
    value = override.value
    if isinstance(value, str) and "${" in value:
        try:
            OmegaConf.create({"value": value})
        except OmegaConfBaseException as exc:
            return _interpolation_problem(override.key, value, exc)
    try:
        OmegaConf.update(cfg, override.key, value, merge=False, force_add=True)
    except OmegaConfBaseException as exc:
        return ConfigProblem(override.key, f"cannot be set: {_first_line(exc)}", value)
    return None


def _resolved(cfg: DictConfig, problems: list[ConfigProblem]) -> dict[str, Any]:
    """The tree with every `${...}` resolved; an interpolation that fails is a problem naming its key and
    expression, and its key is dropped (its default stands in). A `???` (a value to be given) is a problem too."""
    raw = OmegaConf.to_container(cfg, resolve=False)
    broken = []
    for path, value in _leaves(raw):
        if value == "???":
            problems.append(ConfigProblem(path, "needs a value (the config says ???); set it, e.g. " + f"{path}=..."))
            broken.append(path)
        elif isinstance(value, str) and "${" in value:
            try:
                OmegaConf.select(cfg, path, throw_on_missing=True)
            except OmegaConfBaseException as exc:
                problems.append(_interpolation_problem(path, value, exc))
                broken.append(path)
    cfg = OmegaConf.create(without_keys(raw, set(broken)))
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:  # what the leaf check above cannot see, e.g. a cycle through sections
        key = str(getattr(exc, "full_key", "") or "config")
        problems.append(ConfigProblem(key, f"cannot resolve the interpolations: {_first_line(exc)}"))
        return OmegaConf.to_container(cfg, resolve=False)


def _interpolation_problem(path: str, expression: str, exc: Exception) -> ConfigProblem:
    return ConfigProblem(
        path,
        f"cannot resolve the interpolation {expression}: {_first_line(exc)}; point it at an existing key "
        "(e.g. ${actor_rollout_ref.rollout.n}) or give a default with ${oc.select:key,default}",
    )


def _first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


def _leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, value) of every leaf; list items are parts too (`reward.reward_functions.0.path`)."""
    items = tree.items() if isinstance(tree, Mapping) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in items:
        path = f"{prefix}{key}"
        if isinstance(value, (Mapping, list)) and value:
            yield from _leaves(value, f"{path}.")
        else:
            yield path, value


# ----------------------------------------------------------------------------------- plain trees
def without_keys(data: Mapping[str, Any], paths: set[str]) -> dict[str, Any]:
    """A copy of `data` without `paths`; a path that runs into a list (`reward.reward_functions.0.x`) drops
    the deepest mapping key it names (`reward.reward_functions`)."""
    out = copy_tree(data)
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


def copy_tree(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: copy_tree(v) if isinstance(v, Mapping) else v for k, v in data.items()}
