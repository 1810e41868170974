"""Every config key works or is refused: a key that is accepted and ignored is a bug.

Two checks over the whole schema (`OmniFlowConfig`):

1. Coverage: each leaf key is read by the code that runs (outside `omni_core/config/` and
   `omni_core/validation/`), or is listed in `REFUSED_WHEN_NOT_DEFAULT` (its default is all that is
   implemented, any other value is refused before anything starts).
2. The refused-when-not-default table does what it says: each of its keys is refused at a non-default
   value, with a message that names the key and gives the reason, and is accepted at its default.

The matching rule of (1), kept simple on purpose: a key counts as read when its leaf name (the attribute
name, e.g. `temp_dir` for `ray_kwargs.ray_init._temp_dir`) appears in a .py file under omni_core/ (minus
config/ and validation/), flows/, tasks/ or deployments/ as

  * an attribute access (`rollout.log_prob_micro_batch_size_per_gpu`),
  * a string subscript (`section["total_storage_size"]`, `['total_storage_size']`), or
  * a whole string argument of a call (`getattr(cfg, "betas")`, `_field(optim, "betas")`, `d.get("betas")`),

found with `ast`, so comments, docstrings and messages that mention a key do not count. Two indirect
reads count too: a schema property that running code reads (`trainer.checkpoint_dir`) reads the fields
its body uses (`self.default_local_dir`, ...), and a section in `HANDED_WHOLE` is given as a whole to a
library; the verl-omni selectors in `algorithm_names.DERIVED_SELECTORS` are implied by another key and checked
against it. The rule cannot tell `rollout.seed` from `val_kwargs.seed` (one leaf name read anywhere covers
every key of that name); it does catch a key whose name no running code uses, which is how a key gets
accepted and ignored.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from omni_core.config import ConfigError, OmniFlowConfig, load_config
from omni_core.config.algorithm_names import DERIVED_SELECTORS
from omni_core.config.schema import RewardFunctionSpec
from omni_core.config.unsupported import REFUSED_WHEN_NOT_DEFAULT
from omni_core.validation import config_problems

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("omni_core", "flows", "tasks", "deployments")
NOT_RUNTIME = ("omni_core/config", "omni_core/validation")
SCHEMA = ROOT / "omni_core" / "config" / "schema.py"
CPU_ONLY = {"cuda": 0, "npu": 0, "cpu": 2}

# Sections given as a whole to a library, which reads their keys: section -> (the file that hands it over,
# the call it is handed to; the test checks both appear there).
HANDED_WHOLE: dict[str, tuple[str, str]] = {
    # _to_tq_conf turns the section's model_dump into the DictConfig that transfer_queue's tq.init merges.
    "transfer_queue.backend": ("omni_core/tq/client.py", "tq.init(conf)"),
}


def schema_leaves(cls: type[BaseModel] = OmniFlowConfig, prefix: str = "") -> dict[str, str]:
    """Leaf key path (as a user writes it) -> the attribute name code reads it by."""
    leaves: dict[str, str] = {}
    for name, info in cls.model_fields.items():
        key = f"{prefix}{info.alias or name}"
        ann = info.annotation
        # reward.reward_functions is one leaf: a tuple of entries, each consumed whole by the reward manager.
        if isinstance(ann, type) and issubclass(ann, BaseModel) and ann is not RewardFunctionSpec:
            leaves.update(schema_leaves(ann, f"{key}."))
        else:
            leaves[key] = name
    return leaves


def runtime_files() -> list[Path]:
    files = [f for d in SOURCE_DIRS for f in sorted((ROOT / d).rglob("*.py"))]
    return [f for f in files if not any(f.relative_to(ROOT).as_posix().startswith(n + "/") for n in NOT_RUNTIME)]


def _is_str(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def names_read(source: str) -> set[str]:
    """Attribute names, literal string subscripts and whole literal string call arguments in one module."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Subscript) and _is_str(node.slice):
            names.add(node.slice.value)
        elif isinstance(node, ast.Call):
            names.update(arg.value for arg in node.args if _is_str(arg))
    return names


def schema_properties() -> dict[str, set[str]]:
    """Each `@property` of the schema classes -> the `self.<field>` names its body reads."""
    props: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(SCHEMA.read_text())):
        if isinstance(node, ast.FunctionDef) and any(getattr(d, "id", None) == "property" for d in node.decorator_list):
            props[node.name] = {
                n.attr
                for n in ast.walk(node)
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
            }
    return props


@cache
def all_names_read() -> frozenset[str]:
    names: set[str] = set()
    for f in runtime_files():
        names |= names_read(f.read_text())
    for prop, fields in schema_properties().items():
        if prop in names:
            names |= fields
    return frozenset(names)


def unread_keys(leaves: dict[str, str], names: frozenset[str] | set[str]) -> list[str]:
    def handled(key: str, attr: str) -> bool:
        whole = any(key.startswith(section + ".") for section in HANDED_WHOLE)
        return attr in names or whole or key in REFUSED_WHEN_NOT_DEFAULT or key in DERIVED_SELECTORS

    return sorted(key for key, attr in leaves.items() if not handled(key, attr))


# ------------------------------------------------------------------------------------ coverage
def test_every_key_is_read_by_running_code_or_refused_when_not_default():
    unread = unread_keys(schema_leaves(), all_names_read())
    assert not unread, (
        f"{len(unread)} config key(s) are accepted but read by no code outside omni_core/config and "
        "omni_core/validation: implement each, or refuse its non-default values in "
        "omni_core/config/unsupported.py REFUSED_WHEN_NOT_DEFAULT with the reason:\n  " + "\n  ".join(unread)
    )


def test_the_matching_rule_catches_an_unused_key_and_ignores_prose():
    """A dummy key that running code does not read is reported (it was also tried as a real field added to
    the schema and defaults.yaml: the coverage test above failed naming it); mentions in docstrings,
    comments, messages and dict literals do not count, while attribute access, string subscripts and
    literal call arguments do."""
    leaves = {**schema_leaves(), "trainer.dummy_unused_knob": "dummy_unused_knob"}
    assert "trainer.dummy_unused_knob" in unread_keys(leaves, all_names_read())
    prose = (
        '"""Reads trainer.dummy_unused_knob."""\n# trainer.dummy_unused_knob\n'
        'msg = "set trainer.dummy_unused_knob"\nd = {"dummy_unused_knob": 1}\nf(dummy_unused_knob=1)\n'
    )
    assert "dummy_unused_knob" not in names_read(prose)
    for code in ("cfg.trainer.dummy_unused_knob", "section['dummy_unused_knob']", "_field(t, 'dummy_unused_knob')"):
        assert "dummy_unused_knob" in names_read(code), code


def test_indirect_reads_are_real():
    """The schema property runtime code reads, and the sections handed whole, are what the rule assumes."""
    assert schema_properties()["checkpoint_dir"] >= {"default_local_dir", "project_name", "experiment_name"}
    assert "checkpoint_dir" in all_names_read()
    for section, (path, call) in HANDED_WHOLE.items():
        source = (ROOT / path).read_text()
        assert "model_dump" in source and call in source, (section, path)


def test_the_walk_sees_every_section_and_the_runtime_files():
    leaves = schema_leaves()
    assert len(leaves) > 100
    for key in (
        "actor_rollout_ref.actor.fsdp_config.model_dtype",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "ray_kwargs.ray_init._temp_dir",
        "reward.reward_functions",
        "transfer_queue.backend.SimpleStorage.total_storage_size",
    ):
        assert key in leaves, key
    assert leaves["ray_kwargs.ray_init._temp_dir"] == "temp_dir"
    files = {f.relative_to(ROOT).as_posix() for f in runtime_files()}
    assert "omni_core/distributed/ray_cluster.py" in files and "flows/main_diffusion_v1.py" in files
    assert not [f for f in files if f.startswith(NOT_RUNTIME)]


# ------------------------------------------------------------------------------------ refused table
def _non_default(key: str) -> Any:
    """A value of the key's type that is not its default (the first the key's refusal must catch)."""
    default = _value(OmniFlowConfig(), key)
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 1
    if default is None:
        return 2
    return {"drop": "wait", "error": "left", "online": "offline"}[default]


def _value(config: Any, key: str) -> Any:
    for part in key.split("."):
        config = getattr(config, part)
    return config


def test_every_refused_key_is_a_schema_key():
    assert set(REFUSED_WHEN_NOT_DEFAULT) <= set(schema_leaves())


@pytest.mark.parametrize("key", sorted(REFUSED_WHEN_NOT_DEFAULT))
def test_a_refused_key_is_refused_away_from_its_default_and_accepted_at_it(key, tiny_sd3_dir):
    model = f"actor_rollout_ref.model.path={tiny_sd3_dir}"
    default = _value(OmniFlowConfig(), key)
    shown = "null" if default is None else str(default).lower() if isinstance(default, bool) else default
    at_default = load_config(overrides=[model, f"{key}={shown}"])
    assert [p for p in config_problems(at_default, CPU_ONLY) if p.key == key] == []

    value = _non_default(key)
    try:
        config = load_config(overrides=[model, f"{key}={value}"])
    except ConfigError as exc:  # a type limit may refuse it first; then it is not accepted either
        pytest.fail(f"{key}={value} should load and be refused by validation, not by the schema: {exc}")
    problems = [p for p in config_problems(config, CPU_ONLY) if p.key == key]
    assert problems, f"{key}={value} is accepted"
    assert REFUSED_WHEN_NOT_DEFAULT[key] in str(problems[0]) and str(problems[0]).startswith(f"{key}=")


def test_bypass_mode_works_with_the_default_calculate_log_probs(tiny_sd3_dir):
    """calculate_log_probs now defaults to true, so bypass mode needs no second key; false still refuses it."""
    model = f"actor_rollout_ref.model.path={tiny_sd3_dir}"
    assert config_problems(load_config(overrides=[model, "algorithm.rollout_correction.bypass_mode=true"]), CPU_ONLY) == []
    off = load_config(
        overrides=[model, "algorithm.rollout_correction.bypass_mode=true", "actor_rollout_ref.rollout.calculate_log_probs=false"]
    )
    assert [p.key for p in config_problems(off, CPU_ONLY)] == ["algorithm.rollout_correction.bypass_mode"]


def test_the_epoch_bound_is_off_by_default_and_positive_when_set():
    """`trainer.epoch_timeout_s`: no bound unless asked (an epoch may run for days); 0 or less is refused."""
    from omni_core.config import ConfigError, load_config

    assert load_config().trainer.epoch_timeout_s is None
    assert load_config(overrides=["trainer.epoch_timeout_s=86400"]).trainer.epoch_timeout_s == 86400.0
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["trainer.epoch_timeout_s=0"])
    assert err.value.keys == ["trainer.epoch_timeout_s"]
