"""Composing a config as verl / Hydra does (OmegaConf): interpolation, `+key` / `~key` overrides, a `defaults:`
list, and `--config-path/--config-name` through the `omniflow` command's own argument parsing, in-process."""

from __future__ import annotations

import pytest
import yaml
from omniflow.flows.cli import _config_args, build_parser, main
from omniflow.flows.runner import split_files_and_overrides

from omni_core.config import ConfigError, load_config, resolve_config

# A verl-omni style experiment file: values taken from other keys, from a default, from the environment.
EXPERIMENT = """\
actor_rollout_ref:
  rollout:
    n: 4
data:
  train_batch_size: ${actor_rollout_ref.rollout.n}
  val_batch_size: ${oc.select:data.no_such_key,3}
trainer:
  project_name: interp
  experiment_name: ${trainer.project_name}-${oc.env:OMNIFLOW_TEST_RUN_TAG,local}
"""


@pytest.fixture
def experiment(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(EXPERIMENT)
    return path


def test_interpolation_and_oc_select_resolve_before_the_schema_validates(experiment, monkeypatch):
    monkeypatch.setenv("OMNIFLOW_TEST_RUN_TAG", "nightly")
    cfg = load_config(experiment)
    assert cfg.data.train_batch_size == 4  # ${actor_rollout_ref.rollout.n}, an int again (the schema's type)
    assert cfg.data.val_batch_size == 3  # oc.select's default: data.no_such_key is not in the config
    assert cfg.trainer.experiment_name == "interp-nightly"  # two interpolations in one string, one from oc.env
    # An interpolation may point at a key only defaults.yaml sets (the defaults are the first layer).
    cfg = load_config(overrides=["data.val_batch_size=${data.train_batch_size}", "data.train_batch_size=6"])
    assert (cfg.data.train_batch_size, cfg.data.val_batch_size) == (6, 6)


def test_an_override_wins_over_the_file_and_interpolations_see_it(experiment):
    cfg = load_config(experiment, ["actor_rollout_ref.rollout.n=6", "trainer.project_name=cli"])
    assert cfg.actor_rollout_ref.rollout.n == 6
    assert cfg.data.train_batch_size == 6  # resolved after the overrides, as Hydra does
    assert cfg.trainer.experiment_name == "cli-local"
    cfg = load_config(experiment, ["data.train_batch_size=2"])
    assert (cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n) == (2, 4)


def test_a_broken_interpolation_names_the_key_and_the_expression(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("data:\n  train_batch_size: ${actor_rollout_ref.rollout.nn}\n  val_batch_size: ${data.\n")
    with pytest.raises(ConfigError) as err:
        load_config(f, ["trainer.experiment_name=${oc.env:OMNIFLOW_TEST_SURELY_UNSET_VAR}"])
    assert sorted(err.value.keys) == ["data.train_batch_size", "data.val_batch_size", "trainer.experiment_name"]
    text = str(err.value)
    assert "${actor_rollout_ref.rollout.nn}" in text and "${data." in text and "OMNIFLOW_TEST_SURELY_UNSET_VAR" in text


def test_plus_adds_a_key_only_where_the_schema_takes_new_keys():
    cfg = load_config(overrides=["+ray_kwargs.ray_init.runtime_env.env_vars.MY_FLAG=1", "+data.seed=7"])
    assert cfg.ray_kwargs.ray_init.runtime_env == {"env_vars": {"MY_FLAG": 1}}
    assert cfg.data.seed == 7  # + on a key the defaults have sets it (verl scripts write + freely)
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["+data.new_knob=1"])
    assert err.value.keys == ["data.new_knob"]
    assert "unknown key" in str(err.value) and "`+` adds a key" in str(err.value)
    with pytest.raises(ConfigError) as err:  # without +: the unknown key as before, with the nearest valid key
        load_config(overrides=["data.trian_batch_size=3"])
    assert err.value.keys == ["data.trian_batch_size"] and "did you mean data.train_batch_size" in str(err.value)
    with pytest.raises(ConfigError) as err:  # a verl-omni key OmniFlow refuses keeps its reason, with + too
        load_config(overrides=["+actor_rollout_ref.rollout.engine_kwargs.vllm_omni.max_num_seqs=256"])
    assert "vLLM-Omni server knobs do not apply" in str(err.value)


def test_tilde_deletes_a_key_and_its_default_stands_in(experiment):
    cfg = load_config(experiment, ["~data.val_batch_size"])
    assert cfg.data.val_batch_size is None  # defaults.yaml's value: deleting a key removes the file's value too
    with pytest.raises(ConfigError) as err:  # a key an interpolation reads is gone for it too: the reader is named
        load_config(experiment, ["~actor_rollout_ref.rollout.n"])
    assert err.value.keys == ["data.train_batch_size"]
    with pytest.raises(ConfigError) as err:
        load_config(experiment, ["~data.no_such_key", "~trainer.project_name=other"])
    assert err.value.keys == ["~data.no_such_key", "~trainer.project_name"]


def test_a_flow_parameter_config_takes_interpolating_overrides():
    base = load_config(overrides=["trainer.total_epochs=5"])
    cfg = resolve_config(base, ["trainer.save_freq=${trainer.total_epochs}"])
    assert cfg.trainer.save_freq == 5


def test_a_defaults_list_merges_sibling_files_first(tmp_path):
    (tmp_path / "base.yaml").write_text("trainer:\n  total_epochs: 2\n  project_name: base\n")
    (tmp_path / "exp.yaml").write_text("defaults:\n  - base\n  - _self_\ntrainer:\n  project_name: exp\n")
    cfg = load_config(tmp_path / "exp.yaml")
    assert (cfg.trainer.total_epochs, cfg.trainer.project_name) == (2, "exp")
    (tmp_path / "verl.yaml").write_text("defaults:\n  - diffusion_trainer\n  - _self_\n")
    with pytest.raises(ConfigError, match="no file .*diffusion_trainer.yaml.*defaults.yaml is always loaded first"):
        load_config(tmp_path / "verl.yaml")
    (tmp_path / "group.yaml").write_text("defaults:\n  - actor@actor_rollout_ref.actor: dp_actor\n")
    with pytest.raises(ConfigError, match="config groups .* are not supported"):
        load_config(tmp_path / "group.yaml")


def test_config_path_and_config_name_through_the_cli_parser(experiment, tmp_path, capsys):
    folder = str(experiment.parent)
    ns = build_parser().parse_args(["validate", f"--config-path={folder}", "--config-name=exp", "data.seed=1", "~data.shuffle"])
    assert _config_args(ns) == ([str(experiment)], ["data.seed=1", "~data.shuffle"])
    ns = build_parser().parse_args(["train", "-cp", folder, "-cn", "exp.yaml", "trainer.total_epochs=1"])
    assert _config_args(ns) == ([str(experiment)], ["trainer.total_epochs=1"])
    # The words of `python -m omniflow.flows.main_diffusion_v1 --config-path=DIR --config-name=NAME ...`
    assert split_files_and_overrides([f"--config-path={folder}", "extra.yaml", "--config-name", "exp", "a.b=1"]) == (
        [str(experiment), "extra.yaml"],
        ["a.b=1"],
    )
    # The whole command in-process: the named file loaded, an override on top, interpolations resolved.
    assert main(["config", "show", "--config-path", folder, "--config-name", "exp", "actor_rollout_ref.rollout.n=2"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert (shown["data"]["train_batch_size"], shown["trainer"]["experiment_name"]) == (2, "interp-local")
    assert main(["validate", f"--config-path={tmp_path}", "--config-name=missing"]) == 2
    assert "no file" in capsys.readouterr().err
    assert main(["validate", f"--config-path={tmp_path}"]) == 2
    assert "give the config's name too" in capsys.readouterr().err


def test_a_file_may_replace_a_list_with_verl_omnis_reward_mapping(tmp_path):
    """defaults.yaml's `reward_functions: []` is a list; verl-omni writes a {label: entry} mapping over it."""
    f = tmp_path / "rewards.yaml"
    f.write_text("reward:\n  reward_functions:\n    jpeg: {name: jpeg_compressibility, weight: 0.5}\n")
    specs = load_config(f).reward.reward_functions
    assert [(s.name, s.weight) for s in specs] == [("jpeg_compressibility", 0.5)]
