"""Model rewards: CLIP-architecture models loaded with transformers' `from_pretrained` from a local folder (or a Hugging Face
Hub id, read from the Hugging Face cache: `omni_core.models.hub`).

Three rewards, each scored a batch at a time under `torch.no_grad` on the run's device, the CLIP model in the entry's
`dtype`, images prepared by the model's own `CLIPProcessor` (from `processor_path`, default `model_path`):

  pickscore   `logit_scale.exp() * cos(image, prompt) / 26`: flow_grpo's `PickScoreScorer` (PickScore_v1 is a
              CLIP-H fine-tune; the /26 brings typical scores near 0.8-0.9). Needs each image's prompt.
  clip_score  `cos(image, prompt)` of the normalised projected embeddings, in [-1, 1] (torchmetrics' CLIPScore is
              `100 * max(cos, 0)`: use the entry's weight for another scale). Needs each image's prompt.
  aesthetic   the LAION improved aesthetic predictor: an MLP on the normalised CLIP ViT-L/14 image embedding
              (flow_grpo's `AestheticScorer`). The head comes from `head_path`: a `.safetensors` file, or LAION's
              `.pth` state dict (read with `torch.load(weights_only=True)`, which runs no code), with flow_grpo's
              layout `layers.{0,2,4,6,7}.{weight,bias}` (Linear, Dropout, Linear, Dropout, Linear, Dropout, Linear,
              Linear; no activations). The head runs in float32 (a few hundred thousand weights).

A model is loaded once per process and reused (cached by folder, dtype and device), so every rollout worker or
reward server holds one copy however many terms or managers use it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import Tensor, nn

from omni_core.models.hub import TRANSFORMERS_SKIP, is_hub_id, resolve_model_path
from omni_core.rewards.builtin import to_hwc_uint8
from omni_core.rewards.terms import BatchRewardTerm, RewardBatch, SampleFailure

__all__ = ["PICKSCORE_SCALE", "ClipBundle", "aesthetic_scores", "clip_scores", "load_aesthetic_head", "load_clip", "model_term"]

PICKSCORE_SCALE = 26.0  # flow_grpo's normalisation of PickScore logits
MAX_TEXT_TOKENS = 77  # CLIP's text position embeddings
AESTHETIC_LINEAR_LAYERS = (0, 2, 4, 6, 7)  # flow_grpo's MLP: Linear at these Sequential indices, Dropout between

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CACHE: dict[tuple[str, ...], Any] = {}
_CACHE_LOCK = threading.Lock()


@dataclass(frozen=True)
class ClipBundle:
    """A loaded CLIP model with its processor, where it runs and in what precision."""

    model: Any  # transformers.CLIPModel, eval mode
    processor: Any  # transformers.CLIPProcessor (tokenizer + image processor)
    device: torch.device
    dtype: torch.dtype


def _cached(key: tuple[str, ...], load: Any) -> Any:
    with _CACHE_LOCK:  # reward-server threads may ask at once: load once
        if key not in _CACHE:
            _CACHE[key] = load()
        return _CACHE[key]


def load_clip(
    model_path: str | Path,
    processor_path: str | Path | None,
    dtype: str,
    device: torch.device,
    revision: str | None = None,
    where: str = "reward",
) -> ClipBundle:
    """`CLIPModel` and `CLIPProcessor` from local folders, or Hub ids read from the Hugging Face cache
    (`hub.resolve_model_path`; `revision` is the model's, a Hub processor is read at main), on `device` in `dtype`;
    once per process."""
    from transformers import CLIPModel, CLIPProcessor

    model_dir = resolve_model_path(model_path, revision, key=f"{where}.model_path", skip=TRANSFORMERS_SKIP).resolve()
    processor_dir = (
        resolve_model_path(processor_path, key=f"{where}.processor_path", skip=TRANSFORMERS_SKIP).resolve()
        if processor_path
        else model_dir
    )
    key = ("clip", str(model_dir), str(processor_dir), dtype, str(device))

    def load() -> ClipBundle:
        torch_dtype = _DTYPES[dtype]
        model = CLIPModel.from_pretrained(model_dir, local_files_only=True, dtype=torch_dtype).eval().to(device)
        model.requires_grad_(False)
        processor = CLIPProcessor.from_pretrained(processor_dir, local_files_only=True)
        return ClipBundle(model=model, processor=processor, device=device, dtype=torch_dtype)

    return _cached(key, load)


def load_aesthetic_head(head_path: str | Path, in_features: int, device: torch.device) -> nn.Sequential:
    """The LAION aesthetic MLP from a `.safetensors` file or a `.pth` state dict, in float32 on `device`."""
    file = Path(head_path).expanduser().resolve()
    key = ("aesthetic_head", str(file), str(device))

    def load() -> nn.Sequential:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(file))
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)  # plain tensors only: runs no code
        expected = {f"layers.{i}.{p}" for i in AESTHETIC_LINEAR_LAYERS for p in ("weight", "bias")}
        if set(state) != expected:
            raise ValueError(
                f"aesthetic head {file} has keys {sorted(state)[:8]}...; expected flow_grpo's / LAION's MLP layout "
                f"{sorted(expected)} (Linear layers at layers.0, 2, 4, 6, 7)"
            )
        shapes = [tuple(state[f"layers.{i}.weight"].shape) for i in AESTHETIC_LINEAR_LAYERS]
        if shapes[0][1] != in_features or shapes[-1][0] != 1:
            raise ValueError(
                f"aesthetic head {file} maps {shapes[0][1]} features to {shapes[-1][0]}; the CLIP model's image "
                f"embedding has {in_features} (LAION's head expects CLIP ViT-L/14, 768) and the head must end in 1 output"
            )
        linears = [nn.Linear(i, o) for o, i in shapes]
        mlp = nn.Module()  # state-dict keys `layers.N.*`, as LAION saved them
        mlp.layers = nn.Sequential(
            linears[0], nn.Dropout(0.2), linears[1], nn.Dropout(0.2), linears[2], nn.Dropout(0.1), *linears[3:]
        )
        mlp.load_state_dict(state)
        return mlp.layers.eval().requires_grad_(False).to(device)

    return _cached(key, load)


def _features(output: Any) -> Tensor:
    """A `get_*_features` result as a tensor (transformers 5 returns a model output whose pooler_output it is)."""
    if isinstance(output, Tensor):
        return output
    for name in ("pooler_output", "image_embeds", "text_embeds"):
        value = getattr(output, name, None)
        if value is not None:
            return value
    raise TypeError(f"unexpected CLIP feature output {type(output).__name__}")


def _pil(images: Sequence[Any]) -> list[Image.Image]:
    return [Image.fromarray(to_hwc_uint8(img)).convert("RGB") for img in images]


def _image_embeddings(bundle: ClipBundle, images: Sequence[Any]) -> Tensor:
    """Normalised projected image embeddings `[B, D]` in float32."""
    pixels = bundle.processor(images=_pil(images), return_tensors="pt")["pixel_values"]
    emb = _features(bundle.model.get_image_features(pixel_values=pixels.to(bundle.device, bundle.dtype))).float()
    return emb / emb.norm(p=2, dim=-1, keepdim=True)


def _text_embeddings(bundle: ClipBundle, prompts: Sequence[str]) -> Tensor:
    """Normalised projected text embeddings `[B, D]` in float32 (each distinct prompt encoded once)."""
    unique = list(dict.fromkeys(prompts))
    tokens = bundle.processor(text=unique, padding=True, truncation=True, max_length=MAX_TEXT_TOKENS, return_tensors="pt")
    tokens = {k: v.to(bundle.device) for k, v in tokens.items()}
    emb = _features(bundle.model.get_text_features(**tokens)).float()
    emb = emb / emb.norm(p=2, dim=-1, keepdim=True)
    return emb[[unique.index(p) for p in prompts]]


@torch.no_grad()
def clip_scores(bundle: ClipBundle, images: Sequence[Any], prompts: Sequence[str], kind: str) -> Tensor:
    """`[B]` float32: PickScore (`kind="pickscore"`) or the CLIP cosine (`kind="clip_score"`) of each image and prompt."""
    cos = (_image_embeddings(bundle, images) * _text_embeddings(bundle, prompts)).sum(dim=-1)
    if kind == "pickscore":
        return bundle.model.logit_scale.exp().float() * cos / PICKSCORE_SCALE
    return cos


@torch.no_grad()
def aesthetic_scores(bundle: ClipBundle, head: nn.Sequential, images: Sequence[Any]) -> Tensor:
    """`[B]` float32: the aesthetic MLP on each image's normalised CLIP embedding."""
    return head(_image_embeddings(bundle, images)).squeeze(-1)


def model_term(spec: Any, device: str | None, where: str) -> BatchRewardTerm:
    """The batched term of a model-reward entry (`RewardFunctionSpec` with `name` pickscore | clip_score | aesthetic)."""
    from omni_core.models.placement import actor_device

    name = spec.name
    if not spec.model_path:
        raise ValueError(
            f"{where}.model_path: {name} needs model_path, the CLIP model (config.json + weights) and its processor files: "
            "a local folder or a Hugging Face Hub id, e.g. yuvalkirstain/PickScore_v1 for pickscore"
        )
    if not is_hub_id(spec.model_path) and not Path(spec.model_path).expanduser().is_dir():
        raise ValueError(
            f"{where}.model_path={spec.model_path}: no such folder; point it at the local model folder or a Hugging Face Hub id"
        )
    if name == "aesthetic" and not spec.head_path:
        raise ValueError(f"{where}.head_path: aesthetic needs head_path, the MLP head (.safetensors or LAION's .pth)")
    torch_device = actor_device(device or "auto")
    bundle = load_clip(spec.model_path, spec.processor_path, spec.dtype, torch_device, getattr(spec, "revision", None), where)
    head = None
    if name == "aesthetic":
        head = load_aesthetic_head(spec.head_path, bundle.model.config.projection_dim, torch_device)

    def score(batch: RewardBatch) -> list[Any]:
        if head is not None:
            return aesthetic_scores(bundle, head, batch.images).tolist()
        missing = [k for k, p in enumerate(batch.prompts) if p is None]
        ok = [k for k in range(len(batch)) if k not in missing]
        out: list[Any] = [SampleFailure(f"{name} compares the image with its prompt, and no prompt was given")] * len(batch)
        if ok:
            values = clip_scores(bundle, [batch.images[k] for k in ok], [batch.prompts[k] for k in ok], name).tolist()
            for k, v in zip(ok, values, strict=True):
                out[k] = v
        return out

    return BatchRewardTerm(label=name, fn=score, weight=spec.weight, batch_size=spec.batch_size, max_concurrency=1)
