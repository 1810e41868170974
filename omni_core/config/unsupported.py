"""verl-omni keys and values that OmniFlow does not support, each with what OmniFlow offers instead.

A verl-omni recipe carried over unchanged must never be half-honoured: a key is either done as it says
or refused with the reason, before anything starts, never accepted and ignored. Four tables:

  UNSUPPORTED_KEYS          verl-omni keys (or whole sections) OmniFlow has no field for
  UNSUPPORTED_VALUES        values of OmniFlow fields that verl-omni accepts and OmniFlow does not
  REFUSED_WHEN_NOT_DEFAULT  OmniFlow fields that only their default value is implemented for
                            (`omni_core.validation.refused` applies it; the key-coverage test reads it)
  UNKNOWN_IN_SECTION        why any other key of a section OmniFlow has only some keys of is refused
"""

from __future__ import annotations

_FSDP = (
    "OmniFlow's strategies (torch: one rank; ddp; fsdp2: torch's fully_shard per transformer block) do not take this "
    "verl FSDP1 / VeOmni knob. Remove this key."
)
_VLLM = "OmniFlow rolls out with rollout.name=diffusers (the pipeline's own modules in Ray actors); vLLM-Omni server knobs do not apply. Remove this key."
_PROFILER = "profiling hooks are not implemented in OmniFlow; remove this section."
_VIDEO = "OmniFlow generates images (SD3 / FLUX / Qwen-Image pipelines); video and audio-video pipeline settings do not apply. Remove this key."
_VAL_PIPELINE = (
    "validation images use actor_rollout_ref.rollout.pipeline's size, guidance and sequence length; only "
    "actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps differs. Remove this key."
)
_OFFLOAD = (
    "CPU offload needs the FSDP engine of the scale-out work; OmniFlow's torch strategy keeps parameters and "
    "optimizer on the device. Set it to false (or train LoRA with a bf16 actor.fsdp_config.model_dtype to save memory)."
)

# Key paths (or a prefix of them) that verl-omni has and OmniFlow does not.
UNSUPPORTED_KEYS: dict[str, str] = {
    "actor_rollout_ref.ref.fsdp_config": _FSDP,
    "actor_rollout_ref.actor.veomni_config": _FSDP,
    "actor_rollout_ref.ref.veomni_config": _FSDP,
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": _FSDP,
    "actor_rollout_ref.model.fsdp_layer_prefixes": _FSDP,
    "actor_rollout_ref.actor.profiler": _PROFILER,
    "actor_rollout_ref.ref.profiler": _PROFILER,
    "actor_rollout_ref.rollout.profiler": _PROFILER,
    "actor_rollout_ref.actor.optim.clip_grad": "OmniFlow clips gradients with actor_rollout_ref.actor.grad_clip; set that instead.",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": (
        "OmniFlow's warm-up is a step count: set actor_rollout_ref.actor.optim.lr_warmup_steps instead."
    ),
    "actor_rollout_ref.actor.optim.override_optimizer_config": (
        "OmniFlow's optimizer is AdamW with actor_rollout_ref.actor.optim.{lr,betas,weight_decay}; remove this key."
    ),
    "actor_rollout_ref.nccl_timeout": _FSDP,
    "actor_rollout_ref.model.use_shm": (
        "OmniFlow loads models from a local directory or the Hugging Face cache (model.path); remove this key."
    ),
    "actor_rollout_ref.model.external_lib": (
        "OmniFlow supports the diffusers pipelines StableDiffusion3Pipeline, FluxPipeline and QwenImagePipeline; remove this key."
    ),
    "actor_rollout_ref.model.extra_tokenizers": "OmniFlow uses the pipeline's own tokenizers; remove this key.",
    "actor_rollout_ref.model.custom_chat_template": "OmniFlow feeds the raw prompt text to the pipeline's text encoders; remove this key.",
    "actor_rollout_ref.model.trust_remote_code": (
        "OmniFlow loads diffusers pipelines from a local folder and never runs remote code; remove this key."
    ),
    "actor_rollout_ref.model.lora_dtype": (
        "OmniFlow always keeps the LoRA adapters in fp32 (the frozen base follows actor.fsdp_config.model_dtype); remove this key."
    ),
    **{
        f"actor_rollout_ref.rollout.{k}": _VLLM
        for k in (
            "mode tensor_model_parallel_size data_parallel_size expert_parallel_size "
            "pipeline_model_parallel_size gpu_memory_utilization enforce_eager free_cache_engine "
            "max_num_batched_tokens max_model_len max_num_seqs enable_chunked_prefill "
            "enable_prefix_caching load_format layered_summon cudagraph_capture_sizes engine_kwargs "
            "checkpoint_engine step_execution disable_log_stats scheduling_policy logprobs_mode"
        ).split()
    },
    "actor_rollout_ref.rollout.max_prompt_embed_length": (
        "OmniFlow's prompt embeddings are as long as the pipeline's encoders make them (SD3: 77 CLIP tokens + "
        "actor_rollout_ref.rollout.pipeline.max_sequence_length T5 tokens); set pipeline.max_sequence_length instead."
    ),
    "actor_rollout_ref.rollout.prompt_length": "the prompt length limit is data.max_prompt_length; set that instead.",
    "actor_rollout_ref.rollout.agent.default_agent_loop": (
        "OmniFlow has one agent loop (single-turn text-to-image); remove this key."
    ),
    "actor_rollout_ref.rollout.algo.sde_contiguous": (
        "OmniFlow's SDE window is always one contiguous run of steps (verl-omni's sde_contiguous=true); remove this key."
    ),
    **{
        f"actor_rollout_ref.rollout.pipeline.{k}": _VIDEO
        for k in ("num_frames", "frame_rate", "video_flow_shift", "aspect_ratio")
    },
    "actor_rollout_ref.rollout.pipeline.output_type": (
        "rewards score decoded images (uint8); latent outputs for latent reward models are not supported. Remove this key."
    ),
    **{
        f"actor_rollout_ref.rollout.val_kwargs.pipeline.{k}": _VAL_PIPELINE
        for k in (
            "height width guidance_scale true_cfg_scale max_sequence_length num_frames frame_rate "
            "video_flow_shift aspect_ratio output_type"
        ).split()
    },
    "data.trust_remote_code": "OmniFlow reads prompts from parquet / JSONL / text and never runs remote code; remove this key.",
    "reward.reward_manager": "OmniFlow has one reward manager (custom function, weighted reward_functions, or data_source dispatch); remove this key.",
    "trainer.default_hdfs_dir": "OmniFlow writes checkpoints to trainer.default_local_dir only; remove this key.",
    "trainer.esi_redundant_time": "ESI expiry saves are a verl v0 feature; use trainer.save_freq.",
    "trainer.v1.colocate_async": "colocate_async is not implemented (as in verl-omni); use trainer.v1.trainer_mode=sync or separate_async.",
    "trainer.rollout_data_dir": "rollout dumps are not implemented; validation images are saved with each checkpoint.",
    "trainer.validation_data_dir": (
        "validation images are saved with each checkpoint and trainer.log_val_generations sends some to the "
        "trackers; remove this key."
    ),
    "trainer.video_fps": _VIDEO,
    "global_profiler": _PROFILER,
    "algorithm.use_kl_in_reward": "KL is a loss term in OmniFlow (actor.use_kl_loss), never a reward term.",
    "transfer_queue.backend.MooncakeStore": "OmniFlow uses TransferQueue's SimpleStorage backend only.",
}

# (key path, value) pairs verl-omni accepts and OmniFlow rejects, with what to use instead.
UNSUPPORTED_VALUES: dict[str, dict[str, str]] = {
    "actor_rollout_ref.rollout.name": {
        "vllm_omni": "vLLM-Omni rollout is not available in OmniFlow; use actor_rollout_ref.rollout.name=diffusers.",
        "sglang": "SGLang rollout is not available in OmniFlow; use actor_rollout_ref.rollout.name=diffusers.",
    },
    "actor_rollout_ref.actor.strategy": {
        s: f"{s} is not available in OmniFlow; use actor_rollout_ref.actor.strategy=fsdp2 (sharded ranks), ddp "
        "(data-parallel ranks, full parameters on each) or torch (one rank)."
        for s in ("fsdp", "veomni", "megatron")
    },
    "trainer.v1.trainer_mode": {
        "colocate_async": "colocate_async is not implemented (verl-omni has only a yaml stub); use sync or separate_async.",
    },
    "trainer.logger": {
        b: f"the {b} backend is not available in OmniFlow; use console, file, tensorboard, wandb or mlflow."
        for b in ("swanlab", "vemlp_wandb", "clearml", "trackio")
    },
    "transfer_queue.backend.storage_backend": {
        b: f"{b} is not supported; use SimpleStorage." for b in ("MooncakeStore", "Yuanrong", "RayStore")
    },
}

# OmniFlow fields whose default is all that is implemented: any other value is refused with the reason.
# Each is a real schema key (a recipe that sets it to the default passes); drop an entry once the key
# is implemented. `tests/test_config_keys.py` counts these as handled.
REFUSED_WHEN_NOT_DEFAULT: dict[str, str] = {
    "data.dataloader_num_workers": (
        "prompts are held in memory after prepare_dataset checked them against the tokenizer; a loader worker "
        "has nothing to do. Set it to 0."
    ),
    "data.truncation": (
        "OmniFlow refuses a prompt longer than data.max_prompt_length (truncation=error); left / right / middle "
        "truncation is not implemented. Set it to error."
    ),
    "actor_rollout_ref.actor.fsdp_config.param_offload": _OFFLOAD,
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": _OFFLOAD,
    "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size": (
        "sequence parallelism is not implemented; each sample's forward runs on one device. Set it to 1."
    ),
    "reward.num_workers": (
        "rewards are scored inside each rollout worker as its images finish (streaming reward); scale them "
        "with actor_rollout_ref.rollout.agent.num_workers and leave reward.num_workers unset."
    ),
    "trainer.use_v1": "OmniFlow implements only the v1 (TransferQueue) trainer; set trainer.use_v1=true.",
    "trainer.v1.separate_async.sync_compatible": (
        "there is nothing to pause: each separate_async rollout request names the weights it samples with, so a "
        "weight sync never lands inside a request. Keep false."
    ),
    "transfer_queue.enable": (
        "the v1 trainer always moves rollouts through the TransferQueue (verl-omni's v1 runner forces it on "
        "too); set it to true or leave it out."
    ),
}

# Sections OmniFlow implements only some keys of: why any other key under them is refused. `{accepted}`
# is filled with the section's own keys.
UNKNOWN_IN_SECTION: dict[str, str] = {
    "actor_rollout_ref.actor.fsdp_config": (
        "OmniFlow's strategies are torch (one rank), ddp and fsdp2 (torch's fully_shard per transformer block); of verl's FSDP settings it "
        "takes only {accepted}. Remove this key."
    ),
    "ray_kwargs.ray_init": "not a ray.init argument OmniFlow passes on; it accepts {accepted}.",
}


# verl-omni's reward.reward_model section: only `enable: false` is taken (the loader and validation apply this).
REWARD_MODEL_REASON = (
    "verl-omni's reward model is a generative judge served by vLLM on its own GPU pool; OmniFlow takes only "
    "reward.reward_model.enable=false. Run the reward model as a reward.reward_functions entry instead: "
    "{name: pickscore | clip_score | aesthetic, model_path: <local folder>} scores on the run's device, and "
    "{name: <label>, server_url: http://<host>:<port>/score} sends the images to `omniflow reward-server` (OmniFlow's "
    "reward terms on their own GPU or machine) or to any HTTP scorer, e.g. a vLLM judge behind a small adapter."
)


def reward_model_refusal(value: object) -> str | None:
    """Why a `reward.reward_model` section is refused (it sets more than `enable: false`), or None."""
    if isinstance(value, dict) and set(value) <= {"enable"} and value.get("enable") in (False, None):
        return None
    given = sorted(value) if isinstance(value, dict) else [repr(value)]
    return f"{REWARD_MODEL_REASON} (set here: {', '.join(given)})"


def unsupported_key_reason(path: str) -> str | None:
    """Why `path` (or a section above it) is unsupported, or None."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        reason = UNSUPPORTED_KEYS.get(".".join(parts[:i]))
        if reason:
            return reason
    return None
