"""The config schema, the defaults YAML, loading and `key.path=value` overrides."""

from __future__ import annotations

import json

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from omni_core.config import ConfigError, OmniFlowConfig, load_config, parse_value, resolve_config, to_yaml, with_updates
from omni_core.config.defaults_file import DEFAULTS_PATH, flatten, read_comments
from omni_core.config.loader import config_keys


def _schema_leaves(cls: type[BaseModel] = OmniFlowConfig, prefix: str = "") -> dict[str, object]:
    """Leaf key paths as a user writes them (a field's alias, e.g. ray_init's `_temp_dir`) -> field info."""
    leaves = {}
    for name, info in config_keys(cls).items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel) and prefix + name != "reward.reward_functions":
            leaves.update(_schema_leaves(ann, f"{prefix}{name}."))
        else:
            leaves[prefix + name] = info
    return leaves


def test_yaml_and_schema_share_one_key_set():
    yaml_leaves = flatten(yaml.safe_load(DEFAULTS_PATH.read_text()))
    schema_leaves = _schema_leaves()
    assert set(yaml_leaves) == set(schema_leaves)
    assert not [key for key, info in schema_leaves.items() if not info.description], "fields without a description"


def test_every_section_has_a_comment_too():
    comments = read_comments(DEFAULTS_PATH.read_text())
    sections = {k.rsplit(".", 1)[0] for k in flatten(yaml.safe_load(DEFAULTS_PATH.read_text())) if "." in k}
    parents = {".".join(s.split(".")[:i]) for s in sections for i in range(1, s.count(".") + 2)}
    assert not [s for s in parents if s not in comments]


# A handful of fields, written out by hand from defaults.yaml: (default, description = the comment above it).
KNOWN_FIELDS: dict[str, tuple[object, str]] = {
    "data.train_batch_size": (
        2,
        "Prompts per training step; each prompt is sampled actor_rollout_ref.rollout.n times. "
        "verl-omni: 1024; OmniFlow: 2 so a step takes seconds on 2 CPU cores.",
    ),
    "data.val_batch_size": (None, "Prompts per validation batch; null means the whole validation set in one batch."),
    "data.shuffle": (True, "Shuffle the training prompts every epoch (seeded by data.seed)."),
    "actor_rollout_ref.model.path": (
        "models/tiny-sd3",
        "A diffusers pipeline (model_index.json + components): a local directory, or a Hugging Face Hub id such as "
        "stabilityai/stable-diffusion-3.5-medium (a local folder of that name wins), loaded from the Hugging Face cache "
        "(HF_HOME / HF_HUB_CACHE) and downloaded there first unless HF_HUB_OFFLINE=1, the CLI's default. verl-omni: "
        "~/models/Qwen/Qwen-Image; OmniFlow: the tiny SD3-family model that `omniflow make-tiny-model` (and the main "
        "job) builds there.",
    ),
    "actor_rollout_ref.actor.optim.lr": (
        1e-3,
        "Learning rate. verl-omni: 1e-6 (multi-billion-parameter models); "
        "OmniFlow: 1e-3, which moves the 2.3 M-parameter tiny model in a few steps.",
    ),
    "actor_rollout_ref.actor.optim.betas": ((0.9, 0.999), "AdamW betas."),
    "actor_rollout_ref.actor.diffusion_loss.clip_ratio": (
        1e-4,
        "Clip range epsilon of the importance ratio (log-probs are averaged over latent dims, hence tiny). Not read by "
        "flow_dppo.",
    ),
    "actor_rollout_ref.rollout.n": (
        8,
        "Samples per prompt (the GRPO group size); >= 2 for group advantages. verl-omni: 1; OmniFlow: 8.",
    ),
    "actor_rollout_ref.rollout.algo.sde_window_range": (
        (0, 5),
        "[start, end) range of step indices that contains each sample's window; null means [0, num_inference_steps - 1]. "
        "An end of num_inference_steps puts the last step (to sigma 0) in reach, as flow_grpo's base config trains it "
        "(sde and dance_sde; refused for cps).",
    ),
    "trainer.logger": (
        ("console",),
        "Tracking backends: console, file (JSONL + PNGs), tensorboard, wandb (offline under the run's log folder when no "
        "API key is configured), mlflow (MLFLOW_TRACKING_URI, else a local store <checkpoint folder>/mlruns; the final "
        "model as artifact model/). wandb and mlflow keep one run per checkpoint folder. verl-omni: [console, wandb]; "
        "OmniFlow: [console] (no network).",
    ),
    "trainer.total_epochs": (
        6,
        "Training epochs over the prompt set. verl-omni: 30; OmniFlow: 6 "
        "(24 steps of the shipped 8 prompts: the main job fits in 5 minutes on 2 CPU cores).",
    ),
    "trainer.v1.trainer_mode": ("sync", "Trainer mode: sync or separate_async."),
    "transfer_queue.backend.SimpleStorage.num_data_storage_units": (
        None,
        "Storage units (Ray actors, 1 logical CPU each, a Python process with torch). null: sized from the logical CPUs "
        "of the machine that starts the run, 1 per 16, between 1 and 8 (1 on a laptop, verl-omni's 8 from 128 CPUs). "
        "verl-omni: 8; set it for a cluster joined by address.",
    ),
    "ray_kwargs.ray_init.num_cpus": (
        16,
        "Logical CPUs of a local cluster (unused when joining by address); must exceed what TransferQueue, the training "
        "actor and the rollout workers reserve. verl-omni: null; OmniFlow: 16 (more than the cores, see docs/design.md section 7).",
    ),
    # verl's spelling fp32 in the YAML; the config keeps the torch name.
    "actor_rollout_ref.actor.fsdp_config.dtype": (
        None,
        "Compute dtype of the training forward / backward (torch autocast), same spellings; fp16 trains with a gradient "
        "scaler. null: the weights' dtype (model_dtype), so fp32 by default (the tiny CPU main job runs without autocast "
        "and the first on-policy ratio is exactly 1) and a bf16 LoRA base computes in bf16, as verl-omni's recipes do. "
        "fp32 compute on a reduced-precision base needs strategy=fsdp2 (it gathers the parameters in fp32): torch "
        "autocast cannot upcast. verl-omni: bfloat16.",
    ),
    "actor_rollout_ref.rollout.calculate_log_probs": (
        True,
        "Keep the rollout's per-step log-probs. verl-omni: false; OmniFlow: true, as they cost nothing extra and give the "
        "per-step drift metrics training/rollout_probs_diff_max|mean; false skips storing them. "
        "algorithm.rollout_correction.bypass_mode needs true.",
    ),
    "trainer.log_val_generations": (
        0,
        "Validation images sent to the trackers at each validation (the first prompts, sample 0 of each); 0 sends none. "
        "Same default as verl-omni.",
    ),
}


def _get(obj: object, path: str) -> object:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("key", KNOWN_FIELDS)
def test_known_fields_have_their_default_and_description(key):
    default, description = KNOWN_FIELDS[key]
    value = _get(load_config(), key)
    assert value == default and type(value) is type(default), (key, value)
    assert _schema_leaves()[key].description == description


def test_comments_are_read_from_the_lines_directly_above_a_key():
    text = "# the section\na:\n  # first line\n  # second line\n  b: 1\n\n  # cut off by the blank line\n\n  c: 2\n  d: 3\n"
    assert read_comments(text) == {"a": "the section", "a.b": "first line second line"}


def test_dumped_defaults_load_back_to_the_same_values():
    cfg = load_config()
    dumped = flatten(yaml.safe_load(to_yaml(cfg)))
    for key, (default, _) in KNOWN_FIELDS.items():
        assert dumped[key] == (list(default) if isinstance(default, tuple) else default), key


def test_yaml_round_trip(tmp_path):
    cfg = load_config(overrides=["trainer.total_epochs=3", "actor_rollout_ref.model.target_modules=[to_q,to_k]"])
    path = tmp_path / "cfg.yaml"
    path.write_text(to_yaml(cfg))
    again = load_config(path)
    assert again == cfg
    assert again.actor_rollout_ref.model.target_modules == ("to_q", "to_k")


def test_files_merge_in_order_and_overrides_win(tmp_path):
    a = tmp_path / "a.yaml"
    a.write_text("trainer:\n  total_epochs: 5\n  project_name: a\n")
    b = tmp_path / "b.yaml"
    b.write_text("trainer:\n  total_epochs: 7\nactor_rollout_ref:\n  actor:\n    optim:\n      lr: 1e-4\n")
    cfg = load_config([a, b], ["trainer.project_name=c"])
    assert cfg.trainer.total_epochs == 7
    assert cfg.trainer.project_name == "c"
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-4  # PyYAML alone reads "1e-4" as a string


@pytest.mark.parametrize(
    "text, expected",
    [
        ("8", 8),
        ("-3", -3),
        ("1e-4", 1e-4),
        ("3.5", 3.5),
        (".5", 0.5),
        ("2E3", 2000.0),
        ("true", True),
        ("False", False),
        ("null", None),
        ("~", None),
        ("[a,b]", ["a", "b"]),
        ("[0, 5]", [0, 5]),
        ("[]", []),
        ("['x,y', 2]", ["x,y", 2]),
        ("'42'", "42"),
        ('"true"', "true"),
        ("sync", "sync"),
        ("{a: 1}", {"a": 1}),
    ],
)
def test_parse_value_types(text, expected):
    value = parse_value(text)
    assert value == expected and type(value) is type(expected)


def test_overrides_of_every_value_type_reach_the_config():
    cfg = load_config(
        overrides=[
            "data.train_batch_size=8",  # int
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.optim.lr=1e-4",  # float, exponent form
            "data.shuffle=false",  # bool
            "data.val_files=null",  # null
            "trainer.logger=[console,file]",  # list
            "actor_rollout_ref.rollout.algo.sde_window_range=[1,4]",
            "trainer.experiment_name='007'",  # quoted string stays a string
            "+trainer.total_epochs=4",  # Hydra's + prefix
        ]
    )
    assert cfg.data.train_batch_size == 8
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-4
    assert cfg.data.shuffle is False
    assert cfg.data.val_files is None
    assert cfg.trainer.logger == ("console", "file")
    assert cfg.actor_rollout_ref.rollout.algo.sde_window_range == (1, 4)
    assert cfg.trainer.experiment_name == "007"
    assert cfg.trainer.total_epochs == 4


def test_config_is_immutable_and_with_updates_revalidates():
    cfg = load_config()
    with pytest.raises(ValidationError, match="frozen"):
        cfg.trainer.total_epochs = 9  # type: ignore[misc]
    changed = with_updates(cfg, {"trainer.total_epochs": 9})
    assert changed.trainer.total_epochs == 9 and cfg.trainer.total_epochs == 6
    with pytest.raises(ConfigError) as err:
        with_updates(cfg, {"trainer.total_epochs": 0})
    assert err.value.keys == ["trainer.total_epochs"]


def test_derived_checkpoint_dir_is_one_property():
    cfg = load_config(overrides=["trainer.project_name=p", "trainer.experiment_name=e"])
    assert str(cfg.trainer.checkpoint_dir) == "checkpoints/p/e"
    cfg = load_config(overrides=["trainer.default_local_dir=/tmp/ck"])
    assert str(cfg.trainer.checkpoint_dir) == "/tmp/ck"


def test_verl_reward_functions_mapping_is_accepted():
    cfg = load_config(
        overrides=[
            "reward.reward_functions={jpeg: {name: jpeg_compressibility, weight: 0.5}, mine: {path: r.py, name: score, weight: 2}}"
        ]
    )
    specs = cfg.reward.reward_functions
    assert specs[0].name == "jpeg_compressibility" and specs[0].weight == 0.5
    assert specs[1].path == "r.py" and specs[1].function == "score" and specs[1].weight == 2


def test_json_schema_carries_descriptions_and_limits():
    schema = OmniFlowConfig.model_json_schema()
    text = json.dumps(schema)
    assert "Prompts per training step" in text
    data = schema["$defs"]["DataConfig"]["properties"]["train_batch_size"]
    assert data["default"] == 2 and data["exclusiveMinimum"] == 0


def test_flow_parameter_config_takes_overrides_on_top():
    """The flow's `config` parameter (as the Prefect UI sends it) plus verl-style overrides."""
    base = load_config(overrides=["trainer.total_epochs=5"])
    cfg = resolve_config(base, ["actor_rollout_ref.actor.optim.betas=[0.8,0.9]", "+data.seed=1"], [])
    assert (cfg.trainer.total_epochs, cfg.actor_rollout_ref.actor.optim.betas, cfg.data.seed) == (5, (0.8, 0.9), 1)
    with pytest.raises(ConfigError) as err:
        resolve_config(base, ["data.trian_batch_size=3"], [])
    assert err.value.keys == ["data.trian_batch_size"]
