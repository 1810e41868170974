"""Where each copy of the policy runs and in what precision, read from the config in one place.

Two copies exist per run (one under the hybrid engine where `rollout_shares_trained_weights`): the trained one
(the training actor: fp32 master weights, or a ``model_dtype`` base under LoRA, with ``fsdp_config.dtype``
autocast) and the rollout one (each rollout worker: weights in ``rollout.dtype``, no autocast, no gradients).
Both live on ``trainer.device``; inside
a Ray actor that is the accelerator Ray assigned (Ray sets ``CUDA_VISIBLE_DEVICES`` /
``ASCEND_RT_VISIBLE_DEVICES``, so ``cuda`` means the first visible device). The rollout side uses
``rollout.rollout_attn_backend`` translated to the diffusers dispatcher name; the trained side uses
``model.attn_backend`` (the validation checks that the two come from one kernel family).
"""

from __future__ import annotations

import os
from typing import Any

import torch

# verl spellings (PrecisionType) of the dtypes a config may name.
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}

# rollout_attn_backend (vLLM-Omni names) -> diffusers attention-dispatcher name.
ROLLOUT_ATTN_BACKENDS: dict[str, str] = {
    "TORCH_SDPA": "native",
    "FLASH_ATTN": "flash",
    "FLASH_ATTN_HUB": "flash_hub",
    "FLASH_ATTN_3": "_flash_3",
    "FLASH_ATTN_3_HUB": "_flash_3_hub",
}

# The environment variable through which Ray hands each actor its accelerators.
VISIBLE_DEVICES_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


def torch_dtype(name: str) -> torch.dtype:
    """``"bf16"`` / ``"bfloat16"`` / ... -> the torch dtype; a clear error for anything else."""
    try:
        return DTYPES[str(name).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}") from None


def actor_device(device: str) -> torch.device:
    """The device this process computes on for ``trainer.device`` (``auto`` picks cuda, npu or cpu here).

    In a Ray actor that asked for ``num_gpus``, Ray exposes only its assigned GPU(s), so index 0 is the one
    Ray gave it. An accelerator that this process cannot see is an error that says what Ray assigned.
    """
    if device == "auto":  # library use without validate_config (which resolves it for a run)
        from omni_core.device import detect_device

        device = detect_device()
    if device == "cpu":
        return torch.device("cpu")
    if device == "cuda":
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            visible = os.environ.get(VISIBLE_DEVICES_ENV["cuda"])
            raise RuntimeError(
                f"trainer.device=cuda but this process sees no CUDA device ({VISIBLE_DEVICES_ENV['cuda']}={visible!r}); "
                "the Ray actor got no GPU: check the cluster's GPUs (ray status) or use trainer.device=cpu"
            )
        return torch.device("cuda", 0)
    if device == "npu":
        return torch.device("npu", 0)
    raise ValueError(f"trainer.device={device!r}: use auto, cuda, npu or cpu")


def training_policy_kwargs(config: Any) -> dict[str, Any]:
    """``FlowPolicy`` keywords of the trained copy (``config`` is an ``OmniFlowConfig``)."""
    fsdp = config.actor_rollout_ref.actor.fsdp_config
    return {
        "device": actor_device(config.trainer.device),
        "dtype": torch_dtype(fsdp.model_dtype),
        "compute_dtype": torch_dtype(fsdp.compute_dtype),
        "text_encoders": False,  # training reads the prompt embeddings from the trajectories
        "trainable": True,
    }


def rollout_policy_kwargs(config: Any, prompt_embeddings: str | None) -> dict[str, Any]:
    """``FlowPolicy`` keywords of a rollout copy: text encoders only when there is no embedding file."""
    rollout = config.actor_rollout_ref.rollout
    return {
        "device": actor_device(config.trainer.device),
        "dtype": torch_dtype(rollout.dtype),
        "attn_backend": ROLLOUT_ATTN_BACKENDS[rollout.rollout_attn_backend],
        "text_encoders": prompt_embeddings is None,
        "prompt_embeddings": prompt_embeddings,
        "trainable": False,
    }


def rollout_shares_trained_weights(config: Any, prompt_embeddings: str | None) -> bool:
    """Hybrid engine: whether a rank's rollout samples with the trained modules themselves (`FlowPolicy.sampling_view`)
    or needs a copy of its own. Sharing gives the same numbers as a separate rollout copy only when the weights are
    already in `rollout.dtype` with no autocast (`fsdp_config.model_dtype == compute dtype == rollout.dtype`),
    both sides use one attention backend, and the prompts come from an embedding file (the trained copy has no
    text encoders). Otherwise (e.g. fp32 master weights with a bf16 rollout, as on a GPU) the rank keeps a
    `rollout.dtype` copy and refreshes it in-process after each update."""
    arr = config.actor_rollout_ref
    fsdp = arr.actor.fsdp_config
    same_dtype = torch_dtype(fsdp.model_dtype) == torch_dtype(fsdp.compute_dtype) == torch_dtype(arr.rollout.dtype)
    same_attention = ROLLOUT_ATTN_BACKENDS[arr.rollout.rollout_attn_backend] == arr.model.attn_backend
    return prompt_embeddings is not None and same_dtype and same_attention


def module_placement(policy: Any) -> dict[str, dict[str, list[str]]]:
    """``{module name: {"devices": [...], "dtypes": [...]}}`` over every parameter and buffer of every
    computing module of a ``FlowPolicy``: what the placement tests assert, and what an actor reports."""
    out: dict[str, dict[str, list[str]]] = {}
    for name, module in policy.modules_on_device().items():
        tensors = [*module.parameters(), *module.buffers()]
        out[name] = {
            "devices": sorted({str(t.device) for t in tensors}),
            "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in tensors if t.is_floating_point()}),
            "trainable_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in module.parameters() if p.requires_grad}),
        }
    return out
