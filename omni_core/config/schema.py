"""The OmniFlow config schema: verl-omni key paths, types and single-field limits.

Types and limits live here; every default and every description comes from `defaults.yaml`
through `_section(...)`, so there is one place for each (a test checks that the YAML and this
schema have the same key set). Cross-field rules live in `omni_core.validation`.

Models are frozen: a loaded config is immutable; `with_updates` makes a changed copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, create_model, field_validator

from omni_core.config.algorithm_names import ADV_MODE_NAMES, DISTILL_LOSSES, LOSSES, OLD_POLICY_DECAY_SCHEDULE_NAMES
from omni_core.config.defaults_file import load_defaults

_VALUES, _COMMENTS = load_defaults()

PositiveInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
StrList = tuple[str, ...]

# verl's spellings of a dtype (its PrecisionType) -> the torch name the config keeps.
DTYPE_SPELLINGS: dict[str, str] = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}
# A dtype key accepts each spelling (so the JSON schema and the Prefect form offer them all) and keeps the torch name.
DtypeName = Literal["fp32", "float32", "bf16", "bfloat16", "fp16", "float16"]


def torch_dtype_name(name: str) -> str:
    """`fp32` / `bf16` / `fp16` (or the torch names) -> `float32` / `bfloat16` / `float16`; light (no torch).

    `getattr(torch, torch_dtype_name(s))` is the torch dtype.
    """
    canonical = DTYPE_SPELLINGS.get(str(name).lower())
    if canonical is None:
        raise ValueError(f"unknown dtype {name!r}; use fp32 / float32, bf16 / bfloat16 or fp16 / float16")
    return canonical


def _canonical_dtype(value: str | None) -> str | None:
    """An after-validator of `DtypeName` fields: verl's spellings become the torch names (None stays None)."""
    return None if value is None else torch_dtype_name(value)


class _Section:
    """Defaults and descriptions of one YAML section, as pydantic `Field`s."""

    def __init__(self, path: str):
        self.path = path
        node: Any = _VALUES
        for part in path.split("."):
            node = node[part]
        self.values: dict[str, Any] = node

    def __call__(self, name: str, **field_kwargs: Any) -> Any:
        return Field(default=self.values[name], description=_COMMENTS.get(f"{self.path}.{name}"), **field_kwargs)

    def section(self, name: str, cls: type[BaseModel]) -> Any:
        return Field(default_factory=cls, description=_COMMENTS.get(f"{self.path}.{name}"))


class ConfigModel(BaseModel):
    """Base of every section: unknown keys are errors, defaults are validated, values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


# ----------------------------------------------------------------------------------------- data
_d = _Section("data")


_dc = _Section("data.custom_cls")


class CustomClsConfig(ConfigModel):
    path: str | None = _dc("path")
    name: str | None = _dc("name")
    collate_fn: str | None = _dc("collate_fn")


class DataConfig(ConfigModel):
    train_files: str | StrList = _d("train_files")
    val_files: str | StrList | None = _d("val_files")
    prompt_key: str = _d("prompt_key")
    negative_prompt_key: str = _d("negative_prompt_key")
    train_batch_size: PositiveInt = _d("train_batch_size")
    val_batch_size: PositiveInt | None = _d("val_batch_size")
    gen_batch_size: PositiveInt | None = _d("gen_batch_size")
    max_prompt_length: PositiveInt = _d("max_prompt_length")
    truncation: str = _d("truncation")
    shuffle: bool = _d("shuffle")
    seed: int | None = _d("seed")
    dataloader_num_workers: NonNegInt = _d("dataloader_num_workers")
    train_max_samples: int = _d("train_max_samples")
    val_max_samples: int = _d("val_max_samples")
    custom_cls: CustomClsConfig = _d.section("custom_cls", CustomClsConfig)
    img_win_key: str = _d("img_win_key")
    img_lose_key: str = _d("img_lose_key")
    win_score_key: str = _d("win_score_key")
    lose_score_key: str = _d("lose_score_key")


# ------------------------------------------------------------------------------ actor_rollout_ref
_m = _Section("actor_rollout_ref.model")


class ModelConfig(ConfigModel):
    path: str = _m("path")
    revision: str | None = _m("revision")
    tokenizer_path: str | None = _m("tokenizer_path")
    architecture: str | None = _m("architecture")
    algorithm: str = _m("algorithm")
    model_type: Literal["diffusion_model", "diffusion_nft_model", "diffusion_dpo_model"] = _m("model_type")
    policy_state_adapters: StrList = _m("policy_state_adapters")
    attn_backend: str = _m("attn_backend")
    lora_rank: int = _m("lora_rank")
    lora_alpha: float = _m("lora_alpha")
    lora_init_weights: Literal["gaussian", "true"] | bool = _m("lora_init_weights")
    target_modules: str | StrList = _m("target_modules")
    lora_adapter_path: str | None = _m("lora_adapter_path")
    enable_gradient_checkpointing: bool = _m("enable_gradient_checkpointing")


_o = _Section("actor_rollout_ref.actor.optim")


class OptimConfig(ConfigModel):
    lr: PositiveFloat = _o("lr")
    betas: tuple[float, float] = _o("betas")
    weight_decay: Annotated[float, Field(ge=0)] = _o("weight_decay")
    lr_warmup_steps: int = _o("lr_warmup_steps")
    lr_scheduler_type: Literal["constant", "cosine"] = _o("lr_scheduler_type")


_l = _Section("actor_rollout_ref.actor.diffusion_loss")


class _CommonLossConfig(ConfigModel):
    loss_mode: str = _l("loss_mode")
    clip_ratio: PositiveFloat = _l("clip_ratio")
    adv_clip_max: PositiveFloat = _l("adv_clip_max")


# The pydantic type of each `algorithm_names.OptionType`.
_LOSS_OPTION_TYPES: dict[str, Any] = {
    "positive_float": PositiveFloat,
    "non_negative_float": Annotated[float, Field(ge=0)],
    "positive_int": PositiveInt,
    "bool": bool,
}

# The common keys and every registered loss's own keys (`algorithm_names.LOSSES`: name and type there, default and
# description in defaults.yaml), so a loss's keys are written in its registry entry and nowhere else.
DiffusionLossConfig = create_model(
    "DiffusionLossConfig",
    __base__=_CommonLossConfig,
    **{key: (_LOSS_OPTION_TYPES[kind], _l(key)) for entry in LOSSES.values() for key, kind in entry.options.items()},
)


_c = _Section("actor_rollout_ref.actor.checkpoint")


class CheckpointContentsConfig(ConfigModel):
    save_contents: tuple[Literal["model", "optimizer", "extra"], ...] = _c("save_contents")


_fs = _Section("actor_rollout_ref.actor.fsdp_config")


class FsdpConfig(ConfigModel):
    """verl's `actor.fsdp_config`: the precision keys OmniFlow's torch strategy implements, and the
    offload / sequence-parallel keys at their only implemented value (other values are refused)."""

    model_dtype: DtypeName = _fs("model_dtype")
    dtype: DtypeName | None = _fs("dtype")
    param_offload: bool = _fs("param_offload")
    optimizer_offload: bool = _fs("optimizer_offload")
    ulysses_sequence_parallel_size: PositiveInt = _fs("ulysses_sequence_parallel_size")

    _dtypes = field_validator("model_dtype", "dtype")(_canonical_dtype)

    @property
    def compute_dtype(self) -> str:
        """The dtype the training forward / backward computes in: `dtype`, or the weights' (`model_dtype`) when null."""
        return self.dtype or self.model_dtype


_e = _Section("actor_rollout_ref.actor.ema")


class EmaConfig(ConfigModel):
    enable: bool = _e("enable")
    decay: Annotated[float, Field(ge=0, lt=1)] = _e("decay")
    start_step: NonNegInt = _e("start_step")
    update_interval: PositiveInt = _e("update_interval")


_a = _Section("actor_rollout_ref.actor")


class ActorConfig(ConfigModel):
    strategy: Literal["torch", "ddp", "fsdp2"] = _a("strategy")
    use_torch_compile: bool = _a("use_torch_compile")
    ppo_mini_batch_size: PositiveInt = _a("ppo_mini_batch_size")
    ppo_micro_batch_size_per_gpu: PositiveInt = _a("ppo_micro_batch_size_per_gpu")
    ppo_epochs: PositiveInt = _a("ppo_epochs")
    shuffle: bool = _a("shuffle")
    grad_clip: PositiveFloat = _a("grad_clip")
    max_consecutive_nonfinite_steps: PositiveInt = _a("max_consecutive_nonfinite_steps")
    data_loader_seed: int = _a("data_loader_seed")
    optim: OptimConfig = _a.section("optim", OptimConfig)
    diffusion_loss: DiffusionLossConfig = _a.section("diffusion_loss", DiffusionLossConfig)
    use_kl_loss: bool = _a("use_kl_loss")
    kl_loss_coef: Annotated[float, Field(ge=0)] = _a("kl_loss_coef")
    kl_loss_type: Literal["transition_mean", "velocity"] = _a("kl_loss_type")
    use_distill_loss: bool = _a("use_distill_loss")
    distill_loss_mode: Literal[DISTILL_LOSSES] = _a("distill_loss_mode")  # type: ignore[valid-type]
    distill_loss_coef: Annotated[float, Field(gt=0)] = _a("distill_loss_coef")
    detach_uncond_cfg: bool = _a("detach_uncond_cfg")
    window_steps_per_forward: PositiveInt = _a("window_steps_per_forward")
    ema: EmaConfig = _a.section("ema", EmaConfig)
    checkpoint: CheckpointContentsConfig = _a.section("checkpoint", CheckpointContentsConfig)
    fsdp_config: FsdpConfig = _a.section("fsdp_config", FsdpConfig)


_r = _Section("actor_rollout_ref.ref")


class RefConfig(ConfigModel):
    log_prob_micro_batch_size_per_gpu: PositiveInt | None = _r("log_prob_micro_batch_size_per_gpu")


_p = _Section("actor_rollout_ref.rollout.pipeline")


class PipelineConfig(ConfigModel):
    height: PositiveInt = _p("height")
    width: PositiveInt = _p("width")
    num_inference_steps: Annotated[int, Field(ge=2)] = _p("num_inference_steps")
    guidance_scale: Annotated[float, Field(ge=1.0)] = _p("guidance_scale")
    true_cfg_scale: Annotated[float, Field(ge=1.0)] = _p("true_cfg_scale")
    max_sequence_length: PositiveInt = _p("max_sequence_length")


_g = _Section("actor_rollout_ref.rollout.algo")


class SdeAlgoConfig(ConfigModel):
    noise_level: Annotated[float, Field(ge=0)] = _g("noise_level")
    sde_type: Literal["sde", "cps", "dance_sde"] = _g("sde_type")
    sde_window_size: PositiveInt | None = _g("sde_window_size")
    sde_window_range: tuple[NonNegInt, NonNegInt] | None = _g("sde_window_range")
    sample_strategy: Literal["random", "progressive"] = _g("sample_strategy")
    iters_per_group: PositiveInt = _g("iters_per_group")
    sde_window_seed: int = _g("sde_window_seed")
    init_same_noise: bool | None = _g("init_same_noise")


_vp = _Section("actor_rollout_ref.rollout.val_kwargs.pipeline")


class ValPipelineConfig(ConfigModel):
    num_inference_steps: Annotated[int, Field(ge=1)] = _vp("num_inference_steps")


_va = _Section("actor_rollout_ref.rollout.val_kwargs.algo")


class ValAlgoConfig(ConfigModel):
    noise_level: Annotated[float, Field(ge=0)] = _va("noise_level")


_v = _Section("actor_rollout_ref.rollout.val_kwargs")


class ValKwargsConfig(ConfigModel):
    n: PositiveInt = _v("n")
    seed: int = _v("seed")
    pipeline: ValPipelineConfig = _v.section("pipeline", ValPipelineConfig)
    algo: ValAlgoConfig = _v.section("algo", ValAlgoConfig)


_ag = _Section("actor_rollout_ref.rollout.agent")


class AgentConfig(ConfigModel):
    num_workers: PositiveInt = _ag("num_workers")


_ro = _Section("actor_rollout_ref.rollout")


class RolloutConfig(ConfigModel):
    name: Literal["diffusers"] = _ro("name")
    n: PositiveInt = _ro("n")
    seed: int | None = _ro("seed")
    dtype: DtypeName = _ro("dtype")
    rollout_attn_backend: str = _ro("rollout_attn_backend")
    use_torch_compile: bool = _ro("use_torch_compile")
    rollout_adapter: Literal["default", "old"] = _ro("rollout_adapter")
    calculate_log_probs: bool = _ro("calculate_log_probs")
    log_prob_micro_batch_size_per_gpu: PositiveInt | None = _ro("log_prob_micro_batch_size_per_gpu")
    nnodes: NonNegInt = _ro("nnodes")
    n_gpus_per_node: NonNegInt = _ro("n_gpus_per_node")
    pipeline: PipelineConfig = _ro.section("pipeline", PipelineConfig)
    algo: SdeAlgoConfig = _ro.section("algo", SdeAlgoConfig)
    val_kwargs: ValKwargsConfig = _ro.section("val_kwargs", ValKwargsConfig)
    agent: AgentConfig = _ro.section("agent", AgentConfig)

    _dtype = field_validator("dtype")(_canonical_dtype)


_arr = _Section("actor_rollout_ref")


class ActorRolloutRefConfig(ConfigModel):
    hybrid_engine: bool | None = _arr("hybrid_engine")
    model: ModelConfig = _arr.section("model", ModelConfig)
    actor: ActorConfig = _arr.section("actor", ActorConfig)
    ref: RefConfig = _arr.section("ref", RefConfig)
    rollout: RolloutConfig = _arr.section("rollout", RolloutConfig)


# ------------------------------------------------------------------------------------ algorithm
_rc = _Section("algorithm.rollout_correction")


class RolloutCorrectionConfig(ConfigModel):
    bypass_mode: bool = _rc("bypass_mode")
    rollout_is: Literal["token", "sequence"] | None = _rc("rollout_is")
    rollout_is_threshold: float | str = _rc("rollout_is_threshold")
    rollout_is_batch_normalize: bool = _rc("rollout_is_batch_normalize")
    rollout_rs: str | None = _rc("rollout_rs")
    rollout_rs_threshold: float | str | None = _rc("rollout_rs_threshold")


_al = _Section("algorithm")


class AlgorithmConfig(ConfigModel):
    adv_estimator: str = _al("adv_estimator")
    norm_adv_by_std_in_grpo: bool = _al("norm_adv_by_std_in_grpo")
    global_std: bool = _al("global_std")
    std_estimator: Literal["unbiased", "population"] = _al("std_estimator")
    trainer_type: Literal["policy_gradient", "direct_preference"] = _al("trainer_type")
    sample_source: Literal["online", "offline"] = _al("sample_source")
    paired_preference: bool = _al("paired_preference")
    filter_zero_std_groups: bool = _al("filter_zero_std_groups")
    timestep_fraction: Annotated[float, Field(gt=0, le=1)] = _al("timestep_fraction")
    adv_mode: Literal[ADV_MODE_NAMES] = _al("adv_mode")
    old_policy_decay_schedule: Literal[OLD_POLICY_DECAY_SCHEDULE_NAMES] = _al("old_policy_decay_schedule")
    old_policy_decay: Annotated[float, Field(ge=0, le=1)] | None = _al("old_policy_decay")
    old_policy_update_interval: PositiveInt = _al("old_policy_update_interval")
    rollout_correction: RolloutCorrectionConfig = _al.section("rollout_correction", RolloutCorrectionConfig)


# --------------------------------------------------------------------------------------- reward
_cr = _Section("reward.custom_reward_function")


class CustomRewardFunctionConfig(ConfigModel):
    path: str | None = _cr("path")
    name: str = _cr("name")


class RewardFunctionSpec(ConfigModel):
    """One entry of reward.reward_functions, with a weight: a built-in `name`; a `path` + `function`; a model reward
    (`name: pickscore | clip_score | aesthetic` + `model_path`); or a reward server (`server_url`). Which keys each
    kind takes: `omni_core.rewards.entries`.

    Keys outside these fields are kept (not refused here) so that validation reports each with the keys its entry's
    kind takes (`omni_core.validation.reward_terms`), once; the reward manager refuses them too."""

    model_config = ConfigDict(extra="allow", frozen=True, validate_default=True)

    name: str | None = Field(
        None, description="Built-in or model reward name (jpeg_compressibility, pickscore, ...), else the term's label."
    )
    path: str | None = Field(None, description="Python file with a compute_score-style function.")
    function: str = Field("compute_score", description="Function name in that file.")
    weight: float = Field(1.0, description="Weight in the weighted sum.")
    model_path: str | None = Field(
        None, description="Model rewards: the CLIP model, a local folder (from_pretrained) or a Hugging Face Hub id."
    )
    processor_path: str | None = Field(
        None, description="Model rewards: the CLIPProcessor (a local folder or a Hub id); null means model_path."
    )
    revision: str | None = Field(
        None, description="Model rewards: Hub revision (branch, tag or commit) of a model_path that is a Hub id; null means main."
    )
    head_path: str | None = Field(None, description="aesthetic: the MLP head (.safetensors, or LAION's .pth state dict).")
    dtype: DtypeName = Field("float32", description="Model rewards: precision of the model (float32, bfloat16, float16).")
    batch_size: PositiveInt = Field(16, description="Model and server rewards: images per model call or per request.")
    server_url: str | None = Field(None, description="Reward server: the http(s) URL images are POSTed to.")
    headers: dict[str, str] = Field(
        default_factory=dict, description="Reward server: HTTP headers; a value env:NAME is read from that variable per request."
    )
    format: Literal["json", "flow_grpo_pickle"] = Field("json", description="Reward server: wire format.")
    max_concurrency: PositiveInt = Field(4, description="Reward server: requests in flight at once.")
    request_timeout_s: PositiveFloat = Field(120.0, description="Reward server: seconds one request attempt may take.")
    max_retries: NonNegInt = Field(
        2, description="Reward server: retries after the first attempt (connection errors, 408, 429, 5xx)."
    )
    retry_backoff: Annotated[float, Field(ge=0)] = Field(
        0.5, description="Reward server: seconds before the first retry, doubled after each."
    )
    prompts_from: Literal["prompt", "ground_truth"] | None = Field(
        None,
        description="Reward server: what is sent as each image's prompt; null means prompt (ground_truth for verl-omni's http_scorer_client path).",
    )

    _dtype = field_validator("dtype")(_canonical_dtype)


_rm = _Section("reward.reward_model")


class RewardModelConfig(ConfigModel):
    enable: bool = _rm("enable")


_rw = _Section("reward")


class RewardConfig(ConfigModel):
    custom_reward_function: CustomRewardFunctionConfig = _rw.section("custom_reward_function", CustomRewardFunctionConfig)
    reward_model: RewardModelConfig = _rw.section("reward_model", RewardModelConfig)
    reward_functions: tuple[RewardFunctionSpec, ...] = _rw("reward_functions")
    aggregation: Literal["weighted_sum"] = _rw("aggregation")
    num_workers: PositiveInt | None = _rw("num_workers")
    max_failure_ratio: Annotated[float, Field(ge=0, le=1)] = _rw("max_failure_ratio")
    timeout_s: PositiveFloat | None = _rw("timeout_s")

    @field_validator("reward_functions", mode="before")
    @classmethod
    def _accept_verl_forms(cls, value: Any) -> Any:
        """Accept a list of names / entries, or verl-omni's {label: {path, name, weight}} mapping."""
        if isinstance(value, Mapping):
            return reward_entries_from_verl_mapping(value)
        if isinstance(value, (list, tuple)):
            return [{"name": v} if isinstance(v, str) else v for v in value]
        return value


def reward_entries_from_verl_mapping(mapping: Mapping[str, Any]) -> list[dict[str, Any]]:
    """verl-omni's `reward.reward_functions: {label: {path, name: <function>, weight}}` as OmniFlow entries.

    An entry with a `path` is a file: verl's `name` is its function (default `compute_score`) and the
    label becomes its `name` (the label of its score in the extras). An entry without one names a
    built-in reward: its own `name`, else the label. The one converter: the schema and
    `RewardManager` (which also takes raw mappings) both use it.
    """
    entries = []
    for label, spec in mapping.items():
        entry = dict(spec or {})
        if entry.get("path"):
            entry["function"] = entry.pop("name", None) or entry.get("function") or "compute_score"
            entry["name"] = label
        else:
            entry.setdefault("name", label)
        entries.append(entry)
    return entries


# -------------------------------------------------------------------------------------- trainer
_sa = _Section("trainer.v1.separate_async")


class SeparateAsyncConfig(ConfigModel):
    num_warmup_batches: NonNegInt = _sa("num_warmup_batches")
    parameter_sync_step: PositiveInt = _sa("parameter_sync_step")
    sync_compatible: bool = _sa("sync_compatible")


_sm = _Section("trainer.v1.sampler")


class SamplerConfig(ConfigModel):
    max_off_policy_threshold: PositiveInt = _sm("max_off_policy_threshold")
    max_off_policy_strategy: Literal["drop", "wait"] = _sm("max_off_policy_strategy")
    drop_incomplete_groups: bool = _sm("drop_incomplete_groups")
    max_incomplete_group_refill_rounds: PositiveInt = _sm("max_incomplete_group_refill_rounds")


_v1 = _Section("trainer.v1")


class TrainerV1Config(ConfigModel):
    trainer_mode: str = _v1("trainer_mode")
    separate_async: SeparateAsyncConfig = _v1.section("separate_async", SeparateAsyncConfig)
    sampler: SamplerConfig = _v1.section("sampler", SamplerConfig)


_al = _Section("trainer.alerts")


class AlertsConfig(ConfigModel):
    reward_regression_drop: float | None = _al("reward_regression_drop", ge=0)


_cc = _Section("trainer.concurrency")


class ConcurrencyConfig(ConfigModel):
    gpu_limit: Annotated[str, Field(min_length=1, pattern=r"^[^/%&><]+$")] | None = _cc("gpu_limit")
    gpu_limit_size: PositiveInt | None = _cc("gpu_limit_size")


_t = _Section("trainer")


class TrainerConfig(ConfigModel):
    total_epochs: PositiveInt = _t("total_epochs")
    total_training_steps: PositiveInt | None = _t("total_training_steps")
    project_name: str = _t("project_name")
    experiment_name: str = _t("experiment_name")
    logger: tuple[Literal["console", "file", "tensorboard", "wandb", "mlflow"], ...] = _t("logger")
    nnodes: PositiveInt = _t("nnodes")
    n_gpus_per_node: PositiveInt = _t("n_gpus_per_node")
    device: Literal["auto", "cuda", "npu", "cpu"] = _t("device")
    save_freq: int = _t("save_freq")
    test_freq: int = _t("test_freq")
    val_before_train: bool = _t("val_before_train")
    val_only: bool = _t("val_only")
    log_val_generations: NonNegInt = _t("log_val_generations")
    resume_mode: Literal["auto", "disable", "resume_path"] = _t("resume_mode")
    resume_from_path: str | None = _t("resume_from_path")
    default_local_dir: str | None = _t("default_local_dir")
    max_actor_ckpt_to_keep: PositiveInt | None = _t("max_actor_ckpt_to_keep")
    epoch_timeout_s: PositiveFloat | None = _t("epoch_timeout_s")
    use_v1: bool = _t("use_v1")
    concurrency: ConcurrencyConfig = _t.section("concurrency", ConcurrencyConfig)
    alerts: AlertsConfig = _t.section("alerts", AlertsConfig)
    v1: TrainerV1Config = _t.section("v1", TrainerV1Config)

    @field_validator("alerts")
    @classmethod
    def _regression_needs_validations(cls, alerts: AlertsConfig, info: ValidationInfo) -> AlertsConfig:
        """A regression compares validations: without `test_freq` a run validates once at most (before training)."""
        drop, test_freq = alerts.reward_regression_drop, info.data.get("test_freq", -1)
        if drop is not None and test_freq <= 0:
            raise ValueError(
                f"trainer.alerts.reward_regression_drop={drop} compares validation rewards, but trainer.test_freq="
                f"{test_freq} validates at most once (before training); set trainer.test_freq=N (validate every "
                "N steps) or trainer.alerts.reward_regression_drop=null"
            )
        return alerts

    @property
    def checkpoint_dir(self) -> Path:
        """The checkpoint folder: `default_local_dir`, or checkpoints/<project_name>/<experiment_name>."""
        if self.default_local_dir:
            return Path(self.default_local_dir).expanduser()
        return Path("checkpoints") / self.project_name / self.experiment_name


# -------------------------------------------------------------------------------- transfer_queue
_ss = _Section("transfer_queue.backend.SimpleStorage")


class SimpleStorageConfig(ConfigModel):
    total_storage_size: PositiveInt = _ss("total_storage_size")
    num_data_storage_units: PositiveInt | None = _ss("num_data_storage_units")


_tb = _Section("transfer_queue.backend")


class TransferQueueBackendConfig(ConfigModel):
    storage_backend: Literal["SimpleStorage"] = _tb("storage_backend")
    SimpleStorage: SimpleStorageConfig = _tb.section("SimpleStorage", SimpleStorageConfig)


_tq = _Section("transfer_queue")


class TransferQueueConfig(ConfigModel):
    enable: bool = _tq("enable")
    backend: TransferQueueBackendConfig = _tq.section("backend", TransferQueueBackendConfig)


# ----------------------------------------------------------------------------------- ray_kwargs
_ri = _Section("ray_kwargs.ray_init")


class RayInitConfig(ConfigModel):
    """The `ray.init` arguments OmniFlow passes on (verl passes `ray_kwargs.ray_init` to `ray.init(**...)`).

    `_temp_dir` keeps Ray's spelling in configs (pydantic fields cannot start with `_`): the attribute
    is `temp_dir`, the key (in YAML, overrides, dumps and the JSON schema) is `_temp_dir`.
    """

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    address: str | None = _ri("address")
    num_cpus: PositiveInt | None = _ri("num_cpus")
    num_gpus: NonNegInt | None = _ri("num_gpus")
    resources: dict[str, Annotated[float, Field(ge=0)]] | None = _ri("resources")
    object_store_memory: PositiveInt | None = _ri("object_store_memory")
    temp_dir: str | None = _ri("_temp_dir", alias="_temp_dir")
    runtime_env: dict[str, Any] | None = _ri("runtime_env")
    include_dashboard: bool = _ri("include_dashboard")


_rk = _Section("ray_kwargs")


class RayKwargsConfig(ConfigModel):
    ray_init: RayInitConfig = _rk.section("ray_init", RayInitConfig)
    capacity_wait_s: PositiveFloat = _rk("capacity_wait_s")


# -------------------------------------------------------------------------------------- the root
_tm = _Section("distillation.teacher_models.teacher_model")


class TeacherModelConfig(ConfigModel):
    model_path: str | None = _tm("model_path")
    revision: str | None = _tm("revision")


class TeacherModelsConfig(ConfigModel):
    teacher_model: TeacherModelConfig = _Section("distillation.teacher_models").section("teacher_model", TeacherModelConfig)


_dist = _Section("distillation")


class DistillationConfig(ConfigModel):
    enabled: bool = _dist("enabled")
    teacher_models: TeacherModelsConfig = _dist.section("teacher_models", TeacherModelsConfig)


class OmniFlowConfig(ConfigModel):
    """The whole OmniFlow config (verl-omni key paths). Build it with `omni_core.config.load_config`."""

    data: DataConfig = Field(default_factory=DataConfig, description=_COMMENTS.get("data"))
    actor_rollout_ref: ActorRolloutRefConfig = Field(
        default_factory=ActorRolloutRefConfig, description=_COMMENTS.get("actor_rollout_ref")
    )
    distillation: DistillationConfig = Field(default_factory=DistillationConfig, description=_COMMENTS.get("distillation"))
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description=_COMMENTS.get("algorithm"))
    reward: RewardConfig = Field(default_factory=RewardConfig, description=_COMMENTS.get("reward"))
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description=_COMMENTS.get("trainer"))
    transfer_queue: TransferQueueConfig = Field(default_factory=TransferQueueConfig, description=_COMMENTS.get("transfer_queue"))
    ray_kwargs: RayKwargsConfig = Field(default_factory=RayKwargsConfig, description=_COMMENTS.get("ray_kwargs"))
