"""LoRA on the flow transformer through peft: build, load an existing adapter, save, state dicts.

Follows flow_grpo's setup (``get_peft_model`` on the transformer, ``init_lora_weights="gaussian"``; the
reference policy is the same model inside ``disable_adapter()``). Adapters are saved in the diffusers
LoRA format (``pytorch_lora_weights.safetensors`` with keys ``transformer.<module>.lora_{A,B}.weight`` and
the ``LoraConfig`` as metadata), which ``pipeline.load_lora_weights(dir)`` reads; both that format and a
peft ``save_pretrained`` directory (``adapter_config.json``, flow_grpo's checkpoints) load back here.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import DiffusionPipeline
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

from omni_core.models.loader import ModelLoadError

# peft prefixes a PeftModel's state-dict keys with this; diffusers' format uses "transformer." instead.
PEFT_PREFIX = "base_model.model."
DIFFUSERS_PREFIX = "transformer."
LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"


def build_lora_config(
    rank: int,
    alpha: float | None,
    init_weights: str | bool,
    target_modules: list[str] | str,
) -> LoraConfig:
    """``alpha=None`` means alpha = rank (scale 1); ``init_weights`` is ``"gaussian"`` or ``True``."""
    if isinstance(init_weights, str) and init_weights.lower() in ("true", "false"):
        init_weights = init_weights.lower() == "true"
    if isinstance(target_modules, str):
        target_modules = target_modules if target_modules == "all-linear" else [target_modules]
    else:  # any sequence from a config object (list, tuple, ListConfig)
        target_modules = [str(m) for m in target_modules]
    return LoraConfig(
        r=int(rank),
        lora_alpha=float(rank if alpha is None else alpha),
        init_lora_weights=init_weights,
        target_modules=target_modules,
    )


def apply_lora(transformer: torch.nn.Module, config: LoraConfig) -> PeftModel:
    """Wrap ``transformer`` (in place: its linear layers gain LoRA branches); only LoRA params train."""
    return get_peft_model(transformer, config)


def _config_from_diffusers_file(state_dict: dict, metadata: dict | None, fallback: LoraConfig) -> LoraConfig:
    # diffusers prefixes the saved LoraConfig keys with the component name ("transformer.r").
    fields = {k.removeprefix(DIFFUSERS_PREFIX): v for k, v in (metadata or {}).items() if k.startswith(DIFFUSERS_PREFIX)}
    fields = {k: v for k, v in fields.items() if k in LoraConfig.__dataclass_fields__}
    if fields.get("target_modules"):
        return LoraConfig(**fields)
    # No metadata (older files): rank from the A matrices, targets from the key names, alpha as configured.
    ranks = {v.shape[0] for k, v in state_dict.items() if ".lora_A." in k}
    if len(ranks) != 1:
        raise ModelLoadError(f"cannot infer one LoRA rank from the adapter (found {sorted(ranks)})")
    targets = sorted({k.split(".lora_A.")[0] for k in state_dict if ".lora_A." in k})
    rank = ranks.pop()
    alpha = fallback.lora_alpha if fallback.r == rank else rank
    return LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets)


def load_lora_adapter(
    transformer: torch.nn.Module, path: str | Path, pipeline_cls: type[DiffusionPipeline], fallback: LoraConfig
) -> PeftModel:
    """Attach the adapter saved in ``path`` (diffusers LoRA file or peft dir) as a trainable adapter."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"lora_adapter_path {path} does not exist")
    try:
        if (path / "adapter_config.json").is_file():  # peft save_pretrained layout (flow_grpo checkpoints)
            return PeftModel.from_pretrained(transformer, str(path), is_trainable=True)
        state_dict, metadata = pipeline_cls.lora_state_dict(str(path), return_lora_metadata=True)
    except ModelLoadError:
        raise
    except Exception as err:
        raise ModelLoadError(f"{path}: failed to read LoRA adapter: {type(err).__name__}: {err}") from err
    state_dict = {k.removeprefix(DIFFUSERS_PREFIX): v for k, v in state_dict.items() if k.startswith(DIFFUSERS_PREFIX)}
    if not state_dict:
        raise ModelLoadError(f"{path}: adapter has no '{DIFFUSERS_PREFIX}*' LoRA weights")
    config = _config_from_diffusers_file(state_dict, metadata, fallback)
    model = apply_lora(transformer, config)
    load_lora_state(model, {PEFT_PREFIX + k: v for k, v in state_dict.items()}, source=str(path))
    return model


def lora_state(model: PeftModel, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapter weights only, peft key format (``base_model.model.<module>.lora_A.weight``); from
    ``state_dict`` (the model's full state, e.g. gathered from FSDP2 shards) when given."""
    return get_peft_model_state_dict(model, state_dict=state_dict)


def load_lora_state(model: PeftModel, state_dict: dict[str, torch.Tensor], source: str = "state dict") -> None:
    result = set_peft_model_state_dict(model, state_dict)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise ModelLoadError(
            f"{source}: LoRA weights do not match the model: missing {missing[:5]}, unexpected {list(result.unexpected_keys)[:5]}"
        )


def save_lora_adapter(
    model: PeftModel,
    out_dir: str | Path,
    pipeline_cls: type[DiffusionPipeline],
    adapter_state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``out_dir/pytorch_lora_weights.safetensors`` (diffusers format + LoraConfig metadata), of
    ``adapter_state`` (``lora_state``'s keys) when given, else of the model's own adapter weights."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = adapter_state if adapter_state is not None else lora_state(model)
    layers = {k.removeprefix(PEFT_PREFIX): v.detach().contiguous() for k, v in state.items()}
    config = model.peft_config[model.active_adapter]
    metadata = {
        "r": config.r,
        "lora_alpha": config.lora_alpha,
        "target_modules": sorted(config.target_modules),
        "init_lora_weights": config.init_lora_weights,
    }
    pipeline_cls.save_lora_weights(
        out, transformer_lora_layers=layers, transformer_lora_adapter_metadata=metadata, weight_name=LORA_WEIGHT_NAME
    )
    return out / LORA_WEIGHT_NAME
