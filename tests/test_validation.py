"""A catalog of bad configs: each is rejected, and the error names its key path."""

from __future__ import annotations

from pathlib import Path

import pytest
from flow_utils import DIFFUSION_DPO, DIFFUSION_NFT, OFFLINE_DPO

from omni_core.config import ConfigError, load_config
from omni_core.device import auto_set_device
from omni_core.trainers import get_diffusion_trainer_cls, register_diffusion_trainer
from omni_core.validation import config_problems, validate_attention_consistency, validate_config

CPU_ONLY = {"cuda": 0, "npu": 0, "cpu": 2}

NFT = DIFFUSION_NFT  # verl-omni's DiffusionNFT keys (a valid config with the model override)
DPO = DIFFUSION_DPO  # verl-omni's online Diffusion-DPO keys (likewise)
# ... offline, on the small pair file shipped with the tests.
OFFLINE = [*OFFLINE_DPO, f"data.train_files={Path(__file__).parent / 'data' / 'offline_dpo' / 'pairs.jsonl'}"]
# (overrides, key path that the error must name, a fragment of the message)
BAD_CONFIGS: list[tuple[list[str], str, str]] = [
    # unknown keys, typos and unsupported verl-omni keys / values
    (["data.trian_batch_size=4"], "data.trian_batch_size", "did you mean data.train_batch_size"),
    (["trainer.lr=1e-4"], "trainer.lr", "actor_rollout_ref.actor.optim.lr"),
    (["actor_rollout_ref.rollout.nn=4"], "actor_rollout_ref.rollout.nn", "did you mean actor_rollout_ref.rollout.n"),
    (["foo.bar=1"], "foo", "unknown key; valid keys here"),
    # verl's fsdp_config: the precision keys are OmniFlow's; any other key gets the FSDP reason, not "unknown key"
    (
        ["actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params=0"],
        "actor_rollout_ref.actor.fsdp_config.wrap_policy",
        "takes only model_dtype, dtype",
    ),
    (
        ["actor_rollout_ref.actor.fsdp_config.fsdp_size=-1"],
        "actor_rollout_ref.actor.fsdp_config.fsdp_size",
        "of verl's FSDP settings it takes only",
    ),
    (["actor_rollout_ref.ref.fsdp_config.param_offload=true"], "actor_rollout_ref.ref.fsdp_config", "FSDP"),
    (["actor_rollout_ref.actor.fsdp_config.model_dtype=int8"], "actor_rollout_ref.actor.fsdp_config.model_dtype", "bf16"),
    (["ray_kwargs.ray_init.namespace=x"], "ray_kwargs.ray_init.namespace", "accepts address, num_cpus, num_gpus"),
    (
        ["reward.reward_functions={ocr: {name: jpeg_compressibility, lang: 'en'}}"],
        "reward.reward_functions[0].lang",  # validation reports entries (by position), not the loader
        "keyword arguments",
    ),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=2"], "actor_rollout_ref.rollout.tensor_model_parallel_size", "vLLM"),
    (["actor_rollout_ref.rollout.name=vllm_omni"], "actor_rollout_ref.rollout.name", "rollout.name=diffusers"),
    (["actor_rollout_ref.actor.strategy=fsdp"], "actor_rollout_ref.actor.strategy", "strategy=fsdp2 (sharded ranks)"),
    (
        ["actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.actor.fsdp_config.dtype=float16"],
        "actor_rollout_ref.actor.fsdp_config.dtype",
        "without a gradient scaler",
    ),
    (["trainer.v1.trainer_mode=colocate_async"], "trainer.v1.trainer_mode", "not implemented"),
    (["trainer.logger=[console,swanlab]"], "trainer.logger", "not available in OmniFlow"),
    # wrong types and single-field limits
    (["trainer.total_epochs=abc"], "trainer.total_epochs", "integer"),
    (["data.train_batch_size=2.5"], "data.train_batch_size", "integer"),
    (["data.shuffle=maybe"], "data.shuffle", "boolean"),
    (["actor_rollout_ref.actor.optim.lr=0"], "actor_rollout_ref.actor.optim.lr", "greater than 0"),
    (
        ["actor_rollout_ref.actor.diffusion_loss.clip_ratio=-0.1"],
        "actor_rollout_ref.actor.diffusion_loss.clip_ratio",
        "greater than 0",
    ),
    (
        ["actor_rollout_ref.actor.diffusion_loss.adv_clip_max=0"],
        "actor_rollout_ref.actor.diffusion_loss.adv_clip_max",
        "greater than 0",
    ),
    (["actor_rollout_ref.rollout.algo.sde_type=ode"], "actor_rollout_ref.rollout.algo.sde_type", "'sde', 'cps' or 'dance_sde'"),
    (["trainer.resume_mode=sometimes"], "trainer.resume_mode", "auto"),
    (["data=3"], "data", "is a section"),
    # cross-field rules (validate_config)
    (
        ["data.train_batch_size=7", "actor_rollout_ref.actor.ppo_mini_batch_size=2"],
        "data.train_batch_size",
        "divisible by actor_rollout_ref.actor.ppo_mini_batch_size=2; try 8",
    ),
    (
        ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5"],
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "must divide",
    ),
    (["data.gen_batch_size=3", "data.train_batch_size=4"], "data.gen_batch_size", "divide"),
    (
        [
            "trainer.v1.trainer_mode=separate_async",
            "actor_rollout_ref.rollout.nnodes=1",
            "algorithm.rollout_correction.bypass_mode=true",
            "data.train_batch_size=6",
            "actor_rollout_ref.actor.ppo_mini_batch_size=6",
        ],
        "data.train_batch_size",
        "parameter_sync_step",
    ),
    (
        [
            "trainer.v1.trainer_mode=separate_async",
            "actor_rollout_ref.rollout.nnodes=1",
            "algorithm.rollout_correction.bypass_mode=true",
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        ],
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        "must equal data.train_batch_size",
    ),
    (
        [
            "trainer.v1.trainer_mode=separate_async",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "algorithm.rollout_correction.bypass_mode=true",
        ],
        "actor_rollout_ref.rollout.nnodes",
        "standalone rollout pool of actor_rollout_ref.rollout.nnodes x n_gpus_per_node",
    ),
    (
        [
            "trainer.v1.trainer_mode=separate_async",
            "actor_rollout_ref.rollout.nnodes=1",
            "algorithm.rollout_correction.bypass_mode=true",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "trainer.v1.sampler.drop_incomplete_groups=true",
        ],
        "trainer.v1.sampler.drop_incomplete_groups",
        "only trainer.v1.trainer_mode=sync supports it",
    ),
    (
        ["actor_rollout_ref.rollout.algo.sde_window_size=11", "actor_rollout_ref.rollout.algo.sde_window_range=null"],
        "actor_rollout_ref.rollout.algo.sde_window_size",
        "num_inference_steps - 1 = 9",
    ),
    (["actor_rollout_ref.rollout.algo.sde_window_size=10"], "actor_rollout_ref.rollout.algo.sde_window_range", "narrower"),
    (
        ["actor_rollout_ref.rollout.algo.sde_window_range=[3,12]"],
        "actor_rollout_ref.rollout.algo.sde_window_range",
        "0 <= start < end",
    ),
    (["actor_rollout_ref.rollout.algo.sde_window_range=[0,1]"], "actor_rollout_ref.rollout.algo.sde_window_range", "narrower"),
    # The last step (sigma_next = 0) can be an SDE step, except for cps (whose noise there is 0); without a range the
    # window stays off it, and the error says which range takes it in.
    (
        ["actor_rollout_ref.rollout.algo.sde_window_size=10", "actor_rollout_ref.rollout.algo.sde_window_range=null"],
        "actor_rollout_ref.rollout.algo.sde_window_size",
        "sde_window_range=[0,10]",
    ),
    (
        ["actor_rollout_ref.rollout.algo.sde_type=cps", "actor_rollout_ref.rollout.algo.sde_window_range=[8,10]"],
        "actor_rollout_ref.rollout.algo.sde_window_range",
        "sde_type=cps cannot train the last step",
    ),
    (
        ["actor_rollout_ref.actor.diffusion_loss.loss_mode=sd3_dpo"],
        "actor_rollout_ref.actor.diffusion_loss.loss_mode",
        "flow_grpo",
    ),
    (["algorithm.adv_estimator=gae"], "algorithm.adv_estimator", "flow_grpo"),
    (["actor_rollout_ref.model.algorithm=sd3_dpo"], "actor_rollout_ref.model.algorithm", "flow_grpo"),
    # DiffusionNFT: verl-omni's selecting keys together, its old policy on LoRA, and nothing of the SDE sampler.
    (["actor_rollout_ref.model.algorithm=diffusion_nft"], "actor_rollout_ref.actor.diffusion_loss.loss_mode", "=diffusion_nft"),
    ([o for o in NFT if "model.algorithm" not in o], "actor_rollout_ref.model.algorithm", "algorithm=diffusion_nft with it"),
    ([*NFT, "actor_rollout_ref.model.model_type=diffusion_model"], "actor_rollout_ref.model.model_type", "diffusion_nft_model"),
    (
        [*NFT, "actor_rollout_ref.model.model_type=diffusion_dpo_model"],
        "actor_rollout_ref.model.model_type",
        "diffusion_nft_model",
    ),
    ([*NFT, "algorithm.trainer_type=policy_gradient"], "algorithm.trainer_type", "must be direct_preference"),
    (["algorithm.trainer_type=direct_preference"], "algorithm.trainer_type", "must be policy_gradient"),
    ([*NFT, "actor_rollout_ref.model.lora_rank=0"], "actor_rollout_ref.model.lora_rank", "second LoRA adapter"),
    (
        [*NFT, "actor_rollout_ref.model.policy_state_adapters=[default]"],
        "actor_rollout_ref.model.policy_state_adapters",
        "[default,old]",
    ),
    ([*NFT, "actor_rollout_ref.rollout.rollout_adapter=default"], "actor_rollout_ref.rollout.rollout_adapter", "set old"),
    (["actor_rollout_ref.rollout.rollout_adapter=old"], "actor_rollout_ref.rollout.rollout_adapter", "policy_state_adapters"),
    (["algorithm.timestep_fraction=0.5"], "algorithm.timestep_fraction", "sde_window_size"),
    (["algorithm.old_policy_decay=0.5"], "algorithm.old_policy_decay", "read only by DiffusionNFT"),
    (["actor_rollout_ref.actor.diffusion_loss.mix_beta=0.1"], "actor_rollout_ref.actor.diffusion_loss.mix_beta", "diffusion_nft"),
    (
        [*NFT, "actor_rollout_ref.actor.diffusion_loss.clip_ratio=1e-5"],
        "actor_rollout_ref.actor.diffusion_loss.clip_ratio",
        "not read",
    ),
    ([*NFT, "actor_rollout_ref.rollout.algo.sde_window_size=3"], "actor_rollout_ref.rollout.algo.sde_window_size", "ODE"),
    ([*NFT, "actor_rollout_ref.actor.use_kl_loss=true"], "actor_rollout_ref.actor.use_kl_loss", "ref_kl_coef"),
    ([*NFT, "actor_rollout_ref.actor.strategy=fsdp2", "trainer.n_gpus_per_node=2"], "actor_rollout_ref.actor.strategy", "fsdp2"),
    ([*NFT, "actor_rollout_ref.rollout.agent.num_workers=2"], "actor_rollout_ref.rollout.agent.num_workers", "old policy"),
    ([*NFT, "actor_rollout_ref.hybrid_engine=false"], "actor_rollout_ref.hybrid_engine", "old policy"),
    # Online Diffusion-DPO: verl-omni's selecting keys together, pairs of two samples at least, the ODE rollout, sync mode.
    (["actor_rollout_ref.actor.diffusion_loss.loss_mode=dpo"], "actor_rollout_ref.model.algorithm", "algorithm=dpo with it"),
    (["actor_rollout_ref.model.algorithm=dpo"], "actor_rollout_ref.actor.diffusion_loss.loss_mode", "set loss_mode=dpo"),
    ([*DPO, "actor_rollout_ref.model.model_type=diffusion_model"], "actor_rollout_ref.model.model_type", "diffusion_dpo_model"),
    ([o for o in DPO if "paired" not in o], "algorithm.paired_preference", "set it to true"),
    (
        ["algorithm.paired_preference=true", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"],
        "algorithm.paired_preference",
        "flow_grpo is not",
    ),
    ([*DPO, "actor_rollout_ref.rollout.n=1"], "actor_rollout_ref.rollout.n", "Diffusion-DPO two"),
    (
        [*DPO, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"],
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "even",
    ),
    # Offline Diffusion-DPO: a pairs data set, no rollout, reward or validation; data.custom_cls names only its data set.
    ([*OFFLINE, "trainer.val_before_train=true"], "trainer.val_before_train", "nothing to validate"),
    ([*OFFLINE, "trainer.test_freq=1"], "trainer.test_freq", "nothing to validate"),
    ([*OFFLINE, "actor_rollout_ref.rollout.n=16"], "actor_rollout_ref.rollout.n", "not read with algorithm.sample_source=offline"),
    (
        [*OFFLINE, "reward.custom_reward_function.path=examples/rewards/brightness_reward.py"],
        "reward.custom_reward_function.path",
        "carry their scores",
    ),
    (["algorithm.sample_source=offline", "trainer.val_before_train=false", OFFLINE[-1]], "algorithm.sample_source", "only Diffusion-DPO"),
    (["data.custom_cls.path=my_data.py", "data.custom_cls.name=MyDataset"], "data.custom_cls", "no dataset class of its own"),
    (
        [*DPO, "data.custom_cls.path=pkg://verl_omni.utils.dataset.offline_dpo_dataset", "data.custom_cls.name=OfflineDPODataset"],
        "data.custom_cls",
        "set algorithm.sample_source=offline",
    ),
    ([*DPO, "actor_rollout_ref.rollout.algo.noise_level=0.3"], "actor_rollout_ref.rollout.algo.noise_level", "Diffusion-DPO's"),
    ([*DPO, "actor_rollout_ref.actor.use_kl_loss=true"], "actor_rollout_ref.actor.use_kl_loss", "dpo_beta"),
    (
        [*DPO, "actor_rollout_ref.actor.diffusion_loss.adv_clip_max=2"],
        "actor_rollout_ref.actor.diffusion_loss.adv_clip_max",
        "dpo",
    ),
    (
        [*DPO, "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2"],
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
        "inside the update",
    ),
    (
        [*DPO, "actor_rollout_ref.model.policy_state_adapters=[default,old]", "actor_rollout_ref.rollout.rollout_adapter=old"],
        "actor_rollout_ref.model.policy_state_adapters",
        "only by DiffusionNFT",
    ),
    (["actor_rollout_ref.model.algorithm=grpo_guard"], "actor_rollout_ref.model.algorithm", "the loss is actor_rollout_ref"),
    (["actor_rollout_ref.model.algorithm=dance_grpo"], "actor_rollout_ref.model.algorithm", "sde_type=dance_sde"),
    (["algorithm.rollout_correction.rollout_rs=seq_mean_k9"], "algorithm.rollout_correction.rollout_rs", "unknown option"),
    (
        ["algorithm.rollout_correction.rollout_rs=token_k2,binary_kl"],
        "algorithm.rollout_correction.rollout_rs",
        "Gaussian log-density",
    ),
    (["algorithm.rollout_correction.rollout_rs=token_k2"], "algorithm.rollout_correction.rollout_rs_threshold", "must be set"),
    (
        ["algorithm.rollout_correction.rollout_rs=token_k2", "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0"],
        "algorithm.rollout_correction.rollout_rs_threshold",
        "only k1 options take a pair",
    ),
    (
        ["algorithm.rollout_correction.rollout_is=token", "actor_rollout_ref.rollout.calculate_log_probs=false"],
        "algorithm.rollout_correction.rollout_is",
        "calculate_log_probs=true",
    ),
    (
        ["actor_rollout_ref.rollout.algo.sde_window_seed=42"],
        "actor_rollout_ref.rollout.algo.sde_window_seed",
        "read only by MixGRPO",
    ),
    (
        ["actor_rollout_ref.model.algorithm=mix_grpo", "actor_rollout_ref.rollout.algo.iters_per_group=3"],
        "actor_rollout_ref.rollout.algo.iters_per_group",
        "sample_strategy=progressive",
    ),
    (
        ["actor_rollout_ref.model.algorithm=mix_grpo", "actor_rollout_ref.rollout.algo.sde_window_size=null"],
        "actor_rollout_ref.rollout.algo.sde_window_size",
        "MixGRPO (model.algorithm=mix_grpo) places a window",
    ),
    (
        ["actor_rollout_ref.actor.diffusion_loss.loss_mode=flow_dppo", "actor_rollout_ref.actor.diffusion_loss.clip_ratio=0.2"],
        "actor_rollout_ref.actor.diffusion_loss.clip_ratio",
        "is not read by loss_mode flow_dppo",
    ),
    (
        ["actor_rollout_ref.actor.diffusion_loss.kl_mask_threshold=0.1"],
        "actor_rollout_ref.actor.diffusion_loss.kl_mask_threshold",
        "is read only by loss_mode flow_dppo",
    ),
    (
        [
            "actor_rollout_ref.actor.diffusion_loss.loss_mode=grpo_guard",
            "algorithm.rollout_correction.bypass_mode=true",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
        ],
        "algorithm.rollout_correction.bypass_mode",
        "bypass mode skips that pass",
    ),
    (["actor_rollout_ref.model.lora_rank=-1"], "actor_rollout_ref.model.lora_rank", ">= 0"),
    (
        ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=0"],
        "actor_rollout_ref.model.lora_alpha",
        "> 0",
    ),
    (
        # micro-batch 2 keeps the micro-batch rule (8 samples must divide 2 prompts x 1 sample) out of this entry
        ["actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"],
        "actor_rollout_ref.rollout.n",
        "at least 2",
    ),
    (
        [
            "trainer.n_gpus_per_node=4",
            "actor_rollout_ref.actor.strategy=ddp",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        ],
        "trainer.n_gpus_per_node",
        "this machine has 2",
    ),
    (["trainer.nnodes=2"], "actor_rollout_ref.actor.strategy", "asks for 2; use actor_rollout_ref.actor.strategy=ddp"),
    (
        [
            "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.actor.strategy=ddp",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        ],
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "each of the 2 training ranks",
    ),
    # keys at their only implemented value (REFUSED_WHEN_NOT_DEFAULT); tests/test_config_keys.py covers each
    (
        ["actor_rollout_ref.actor.fsdp_config.param_offload=true"],
        "actor_rollout_ref.actor.fsdp_config.param_offload",
        "CPU offload",
    ),
    (
        ["actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2"],
        "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size",
        "sequence parallelism",
    ),
    (["actor_rollout_ref.rollout.nnodes=1"], "actor_rollout_ref.rollout.nnodes", "only trainer.v1.trainer_mode=separate_async"),
    (["transfer_queue.enable=false"], "transfer_queue.enable", "always moves rollouts through the TransferQueue"),
    (["reward.num_workers=1"], "reward.num_workers", "streaming reward"),
    (["data.truncation=left"], "data.truncation", "only error is implemented"),
    (
        ["trainer.v1.sampler.max_off_policy_threshold=1"],
        "trainer.v1.sampler.max_off_policy_threshold",
        "only trainer.v1.trainer_mode=separate_async",
    ),
    # precision and ray_init combinations
    (
        ["actor_rollout_ref.actor.fsdp_config.model_dtype=bf16"],
        "actor_rollout_ref.actor.fsdp_config.model_dtype",
        "only with LoRA",
    ),
    (["ray_kwargs.ray_init.address=auto", "ray_kwargs.ray_init.num_gpus=1"], "ray_kwargs.ray_init.num_gpus", "joins an existing"),
    (
        ["ray_kwargs.ray_init.address=auto", "ray_kwargs.ray_init._temp_dir=/tmp/ray-x"],
        "ray_kwargs.ray_init._temp_dir",
        "joins an existing",
    ),
    (
        ["ray_kwargs.ray_init.runtime_env={env_vars: {NCCL_DEBUG: 1}}"],
        "ray_kwargs.ray_init.runtime_env.env_vars",
        "must map names to strings",
    ),
    (["ray_kwargs.ray_init.num_cpus=2"], "ray_kwargs.ray_init.num_cpus", "too few logical CPUs"),
    (["trainer.experiment_name=../../etc"], "trainer.experiment_name", "plain folder name"),
    (["trainer.project_name=/abs/path"], "trainer.project_name", "plain folder name"),
    (["trainer.resume_mode=resume_path"], "trainer.resume_from_path", "must be set"),
    (["trainer.resume_mode=resume_path", "trainer.resume_from_path=/no/such/ckpt"], "trainer.resume_from_path", "does not exist"),
    (["trainer.use_v1=false"], "trainer.use_v1", "only the v1"),
    (["trainer.v1.trainer_mode=turbo"], "trainer.v1.trainer_mode", "available: separate_async, sync"),
    (
        ["algorithm.rollout_correction.bypass_mode=true", "actor_rollout_ref.rollout.calculate_log_probs=false"],
        "algorithm.rollout_correction.bypass_mode",
        "calculate_log_probs=true",
    ),
    (["data.train_files=/no/such/prompts.parquet"], "data.train_files", "not found"),
    (["actor_rollout_ref.model.lora_adapter_path=/x"], "actor_rollout_ref.model.lora_adapter_path", "lora_rank > 0"),
    (["actor_rollout_ref.model.path=/no/such/model"], "actor_rollout_ref.model.path", "omniflow make-tiny-model"),
    (
        ["actor_rollout_ref.rollout.pipeline.true_cfg_scale=4.0"],
        "actor_rollout_ref.rollout.pipeline.true_cfg_scale",
        "StableDiffusion3Pipeline has no true CFG",
    ),
    (
        [
            "trainer.v1.trainer_mode=separate_async",
            "actor_rollout_ref.rollout.nnodes=1",
            "algorithm.rollout_correction.bypass_mode=true",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "trainer.v1.separate_async.num_warmup_batches=2",
            "trainer.v1.separate_async.parameter_sync_step=2",
            "trainer.v1.sampler.max_off_policy_threshold=1",
        ],
        "trainer.v1.sampler.max_off_policy_threshold",
        "so each group is trained 3 global steps after its prompt was submitted",
    ),
    (
        [
            "trainer.v1.trainer_mode=separate_async",
            "actor_rollout_ref.rollout.nnodes=1",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        ],
        "algorithm.rollout_correction.bypass_mode",
        "this schedule trains samples up to 4 model versions stale",
    ),
    (
        [
            "trainer.v1.trainer_mode=separate_async",
            "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=2",
            "algorithm.rollout_correction.bypass_mode=true",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.agent.num_workers=3",
        ],
        "actor_rollout_ref.rollout.agent.num_workers",
        "leave num_workers at 1 or set it to 2",
    ),
    # attention pairing
    (
        ["actor_rollout_ref.model.attn_backend=_flash_3"],
        "actor_rollout_ref.model.attn_backend",
        "rollout_attn_backend=FLASH_ATTN_3",
    ),
    (["actor_rollout_ref.rollout.rollout_attn_backend=FLASH_ATTN"], "actor_rollout_ref.model.attn_backend", "does not pair"),
    (["actor_rollout_ref.model.attn_backend=xformers_magic"], "actor_rollout_ref.model.attn_backend", "known: native"),
    (
        ["actor_rollout_ref.rollout.rollout_attn_backend=SDPA"],
        "actor_rollout_ref.rollout.rollout_attn_backend",
        "known: TORCH_SDPA",
    ),
]


@pytest.fixture(scope="module")
def model(tiny_sd3_dir) -> str:
    """An override pointing model.path at a real (tiny) pipeline, so only the broken key fails."""
    return f"actor_rollout_ref.model.path={tiny_sd3_dir}"


def _errors_of(overrides: list[str], model: str) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        validate_config(load_config(overrides=[model, *overrides]), device_counts=CPU_ONLY)
    return err.value


def _also_reported(overrides: list[str]) -> set[str]:
    """Keys a catalogued config is rightly rejected at besides its own (none since separate_async exists)."""
    return set()


@pytest.mark.parametrize("overrides, key, fragment", BAD_CONFIGS, ids=[" ".join(c[0])[:60] for c in BAD_CONFIGS])
def test_bad_config_is_rejected_with_its_key_path(overrides, key, fragment, model):
    err = _errors_of(overrides, model)
    matching = [p for p in err.problems if p.key == key]
    assert matching, f"no problem names {key}: {err}"
    assert any(fragment in str(p) for p in matching), str(err)
    assert key in str(err)
    # Rejected for its own fault only: no problem at a key that this entry does not break.
    assert {p.key for p in err.problems} == {key} | _also_reported(overrides), str(err)


def test_default_config_is_valid(model):
    validate_config(load_config(overrides=[model]), device_counts=CPU_ONLY)


@pytest.mark.parametrize("sde_type", ["sde", "dance_sde"])
def test_a_window_over_every_step_including_the_last_is_valid_as_flow_grpo_trains_it(model, sde_type):
    every_step = ["actor_rollout_ref.rollout.algo.sde_window_size=10", "actor_rollout_ref.rollout.algo.sde_window_range=[0,10]"]
    validate_config(
        load_config(overrides=[model, *every_step, f"actor_rollout_ref.rollout.algo.sde_type={sde_type}"]),
        device_counts=CPU_ONLY,
    )


def test_diffusion_nft_as_verl_omni_selects_it_is_valid(model):
    validate_config(
        load_config(overrides=[model, *NFT, "algorithm.timestep_fraction=0.5", "algorithm.adv_mode=binary"]),
        device_counts=CPU_ONLY,
    )


def test_online_dpo_as_verl_omni_selects_it_is_valid_with_or_without_the_hybrid_engine(model):
    validate_config(
        load_config(overrides=[model, *DPO, "actor_rollout_ref.actor.diffusion_loss.dpo_beta=100"]), device_counts=CPU_ONLY
    )
    validate_config(load_config(overrides=[model, *DPO, "actor_rollout_ref.hybrid_engine=false"]), device_counts=CPU_ONLY)


def test_all_problems_are_reported_together(model):
    err = _errors_of(["data.train_batch_size=7", "trainer.experiment_name=../x", "actor_rollout_ref.rollout.n=1"], model)
    assert {"data.train_batch_size", "trainer.experiment_name", "actor_rollout_ref.rollout.n"} <= set(err.keys)


def test_the_error_shows_the_value_given(model):
    err = _errors_of(["data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=4"], model)
    assert "data.train_batch_size=6: must be divisible by actor_rollout_ref.actor.ppo_mini_batch_size=4; try 8" in str(err)


def test_attention_pairs_that_are_valid():
    for actor, rollout in [("native", "TORCH_SDPA"), ("_flash_3", "FLASH_ATTN_3"), ("flash", "FLASH_ATTN")]:
        validate_attention_consistency(
            load_config(
                overrides=[
                    f"actor_rollout_ref.model.attn_backend={actor}",
                    f"actor_rollout_ref.rollout.rollout_attn_backend={rollout}",
                ]
            )
        )


def test_detect_device_prefers_cuda_then_npu_then_cpu():
    from omni_core.device import detect_device

    assert detect_device({"cuda": 2, "npu": 0, "cpu": 8}) == "cuda"
    assert detect_device({"cuda": 1, "npu": 4, "cpu": 8}) == "cuda"
    assert detect_device({"cuda": 0, "npu": 1, "cpu": 8}) == "npu"
    assert detect_device({"cuda": 0, "npu": 0, "cpu": 8}) == "cpu"


def _present_device() -> str:
    """What this machine has, asked of torch (and torch_npu when installed) directly, not through omni_core.device."""
    import importlib.util

    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return "cuda"
    if importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401  (registers torch.npu)

        if torch.npu.device_count() > 0:  # type: ignore[attr-defined]
            return "npu"
    return "cpu"


def test_auto_set_device_resolves_and_rejects_absent_devices():
    # auto is the device this machine has: never an absent one (a CPU machine gets cpu, not cuda).
    assert auto_set_device(load_config()).trainer.device == _present_device()
    assert auto_set_device(load_config(overrides=["trainer.device=cpu"])).trainer.device == "cpu"
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ConfigError) as err:
            auto_set_device(load_config(overrides=["trainer.device=cuda"]))
        assert err.value.keys == ["trainer.device"] and "trainer.device=auto" in str(err.value)
        # A run that joins a cluster may have a driver without a GPU: the cluster's GPUs are checked once
        # connected (check_cluster_devices), so neither the device nor the per-node count is checked here.
        joined = ["trainer.device=cuda", "ray_kwargs.ray_init.address=10.0.0.1:6379", "trainer.n_gpus_per_node=8"]
        joined += ["actor_rollout_ref.actor.strategy=ddp", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]
        cfg = auto_set_device(load_config(overrides=joined))
        assert cfg.trainer.device == "cuda"
        assert not [p for p in config_problems(cfg) if p.key in ("trainer.device", "trainer.n_gpus_per_node")]


def test_trainer_registry():
    assert get_diffusion_trainer_cls("sync").mode == "sync"
    assert get_diffusion_trainer_cls("separate_async").mode == "separate_async"
    with pytest.raises(ValueError, match="available: separate_async, sync"):
        get_diffusion_trainer_cls("colocate_async")


def test_registering_a_taken_mode_name_is_refused():
    with pytest.raises(ValueError, match="already registered"):

        @register_diffusion_trainer("sync")
        class Other:
            pass


def test_a_strategy_the_installed_torch_cannot_run_on_the_device_is_refused():
    """The real torch of this machine: a CPU build has gloo and FSDP2 but no NCCL, so ddp / fsdp2 ranks on cuda
    are refused by name (backend, device, torch version) and the same strategies on cpu pass."""
    import torch
    import torch.distributed as dist

    from omni_core.config import load_config
    from omni_core.validation.devices import distributed_problems

    for strategy in ("ddp", "fsdp2"):
        config = load_config(overrides=[f"actor_rollout_ref.actor.strategy={strategy}", "trainer.n_gpus_per_node=2"])
        assert distributed_problems(config, "cpu") == []
        problems = distributed_problems(config, "cuda")
        if dist.is_nccl_available():  # a CUDA build: NCCL is there, nothing to refuse
            assert problems == []
            continue
        (problem,) = problems
        assert problem.key == "actor_rollout_ref.actor.strategy" and problem.value == strategy
        assert f"torch {torch.__version__} has no nccl backend" in problem.message
        assert f"strategy={strategy} uses on trainer.device=cuda" in problem.message
    assert distributed_problems(load_config(), "cuda") == []  # one rank, strategy=torch: no process group


def test_a_refused_reward_entry_key_is_reported_once_by_validation(model):
    """The loader leaves reward entries to validation: one problem per refused key, with the reason and the fix."""
    from omni_core.validation import prepare_run_config

    with pytest.raises(ConfigError) as err:
        prepare_run_config(None, [model, "reward.reward_functions=[{name: jpeg_compressibility, required: true, wieght: 2}]"])
    assert err.value.keys == ["reward.reward_functions[0].required", "reward.reward_functions[0].wieght"]
    required, typo = err.value.problems
    assert "not supported by OmniFlow: OmniFlow never turns a failed reward into a score" in required.message
    assert "set reward.max_failure_ratio" in required.message
    assert typo.message.startswith("not supported by OmniFlow: unknown key; a built-in reward entry ('jpeg_compressibility')")
    assert "takes name, weight" in typo.message and "keyword arguments" in typo.message


def test_a_mode_a_user_registers_validates(model, monkeypatch):
    """Validation reads the mode names from the config layer, where the trainer registry records each it registers."""
    from omni_core.config import trainer_modes
    from omni_core.trainers import registry

    monkeypatch.setattr(registry, "DIFFUSION_TRAINER_REGISTRY", dict(registry.DIFFUSION_TRAINER_REGISTRY))
    monkeypatch.setattr(trainer_modes, "_ADDED", set(trainer_modes._ADDED))
    config = load_config(overrides=[model, "trainer.v1.trainer_mode=my_mode"])
    assert "trainer.v1.trainer_mode" in {p.key for p in config_problems(config, CPU_ONLY)}

    @register_diffusion_trainer("my_mode")
    class MyMode:
        pass

    assert "trainer.v1.trainer_mode" not in {p.key for p in config_problems(config, CPU_ONLY)}
