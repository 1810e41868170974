"""verl-omni keys and values that OmniFlow does not support, each with what OmniFlow offers instead.

A verl-omni recipe carried over unchanged must never be half-honoured: these keys and values are
rejected with the reason, instead of being silently ignored.
"""

from __future__ import annotations

_FSDP = (
    "OmniFlow trains with actor.strategy=torch (one Ray actor, plain PyTorch); FSDP / VeOmni knobs do not apply. Remove this key."
)
_VLLM = "OmniFlow rolls out with rollout.name=diffusers (the pipeline's own modules in Ray actors); vLLM-Omni server knobs do not apply. Remove this key."

# Key paths (or a prefix of them) that verl-omni has and OmniFlow does not.
UNSUPPORTED_KEYS: dict[str, str] = {
    "actor_rollout_ref.actor.fsdp_config": _FSDP,
    "actor_rollout_ref.ref.fsdp_config": _FSDP,
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": _FSDP,
    "actor_rollout_ref.actor.use_distill_loss": "distillation losses are not implemented in OmniFlow; remove this key.",
    "actor_rollout_ref.hybrid_engine": "OmniFlow always colocates actor and rollout in sync mode; remove this key.",
    "actor_rollout_ref.nccl_timeout": _FSDP,
    "actor_rollout_ref.model.use_shm": "OmniFlow loads models from a local directory (model.path); remove this key.",
    "actor_rollout_ref.model.external_lib": "OmniFlow supports the diffusers pipelines StableDiffusion3Pipeline and FluxPipeline; remove this key.",
    "actor_rollout_ref.model.extra_tokenizers": "OmniFlow uses the pipeline's own tokenizers; remove this key.",
    "actor_rollout_ref.model.custom_chat_template": "OmniFlow feeds the raw prompt text to the pipeline's text encoders; remove this key.",
    **{
        f"actor_rollout_ref.rollout.{k}": _VLLM
        for k in (
            "mode tensor_model_parallel_size data_parallel_size expert_parallel_size "
            "pipeline_model_parallel_size gpu_memory_utilization enforce_eager free_cache_engine "
            "max_num_batched_tokens max_model_len max_num_seqs enable_chunked_prefill "
            "enable_prefix_caching load_format layered_summon cudagraph_capture_sizes engine_kwargs "
            "checkpoint_engine"
        ).split()
    },
    "reward.reward_model": "model-based rewards served on their own pool are not supported; use reward.custom_reward_function or reward.reward_functions.",
    "reward.reward_manager": "OmniFlow has one reward manager (custom function, weighted reward_functions, or data_source dispatch); remove this key.",
    "trainer.default_hdfs_dir": "OmniFlow writes checkpoints to trainer.default_local_dir only; remove this key.",
    "trainer.esi_redundant_time": "ESI expiry saves are a verl v0 feature; use trainer.save_freq.",
    "trainer.v1.colocate_async": "colocate_async is not implemented (as in verl-omni); use trainer.v1.trainer_mode=sync or separate_async.",
    "trainer.rollout_data_dir": "rollout dumps are not implemented; validation images are saved with each checkpoint.",
    "global_profiler": "profiling hooks are not implemented in OmniFlow; remove this section.",
    "distillation": "distillation is not implemented in OmniFlow; remove this section.",
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
        s: f"{s} is not available in OmniFlow; use actor_rollout_ref.actor.strategy=torch."
        for s in ("fsdp", "fsdp2", "veomni", "megatron")
    },
    "actor_rollout_ref.rollout.algo.sde_type": {
        "dance_sde": "the DanceGRPO SDE is not implemented; use sde_type=sde or cps.",
    },
    "trainer.v1.trainer_mode": {
        "colocate_async": "colocate_async is not implemented (verl-omni has only a yaml stub); use sync or separate_async.",
    },
    "trainer.logger": {
        b: f"the {b} backend needs a network service; use console, file or tensorboard."
        for b in ("wandb", "mlflow", "swanlab", "vemlp_wandb", "clearml", "trackio")
    },
    "transfer_queue.backend.storage_backend": {
        b: f"{b} is not supported; use SimpleStorage." for b in ("MooncakeStore", "Yuanrong", "RayStore")
    },
}


def unsupported_key_reason(path: str) -> str | None:
    """Why `path` (or a section above it) is unsupported, or None."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        reason = UNSUPPORTED_KEYS.get(".".join(parts[:i]))
        if reason:
            return reason
    return None
