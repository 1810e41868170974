"""Training precision: `actor.fsdp_config.model_dtype` below fp32 only under LoRA.

Full fine-tuning keeps fp32 master weights and optimizer state (AdamW's updates of bf16 weights round
away), so only LoRA may load its frozen base in bf16 / fp16; its adapters stay fp32. The compute dtype
(`fsdp_config.dtype`, autocast) is free: fp16 trains with a gradient scaler.
"""

from __future__ import annotations

from omni_core.config import ConfigProblem, OmniFlowConfig


def precision_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    p: list[ConfigProblem] = []
    model, fsdp = config.actor_rollout_ref.model, config.actor_rollout_ref.actor.fsdp_config
    lora = model.lora_rank > 0 or bool(model.lora_adapter_path)
    if fsdp.model_dtype != "float32" and not lora:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.actor.fsdp_config.model_dtype",
                "a reduced-precision model is allowed only with LoRA (the frozen base then sits in this dtype and the "
                "adapters stay fp32); full fine-tuning keeps fp32 master weights and optimizer state. Set "
                "model_dtype=fp32, or train LoRA (actor_rollout_ref.model.lora_rank > 0)",
                fsdp.model_dtype,
            )
        )
    if fsdp.dtype == "float32" and fsdp.model_dtype != "float32" and config.actor_rollout_ref.actor.strategy != "fsdp2":
        p.append(
            ConfigProblem(
                "actor_rollout_ref.actor.fsdp_config.dtype",
                f"fp32 compute on a {fsdp.model_dtype} base (fsdp_config.model_dtype) cannot run under torch autocast, which "
                "only lowers precision (torch would disable it and compute in the base's dtype): remove the key (null "
                f"computes in {fsdp.model_dtype}), or use actor.strategy=fsdp2, which gathers the parameters in fp32",
                fsdp.dtype,
            )
        )
    return p
