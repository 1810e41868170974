"""Tiny random-weight CLIP reward models, built offline and saved the way real ones are distributed.

`build_tiny_clip(dir)` writes a folder that loads through the same code path as a downloaded PickScore_v1 or
openai/clip-vit-large-patch14 folder: a `CLIPModel` (`save_pretrained`), its `CLIPProcessor` (the byte-level
`CLIPTokenizer` built in memory by `omni_core.models.tiny` + a `CLIPImageProcessor` with CLIP's mean / std), and
`aesthetic_head.safetensors`, an MLP head with LAION's layout (`layers.{0,2,4,6,7}`) sized for this model's
projection. `omniflow make-tiny-model DIR --arch clip` runs it.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["AESTHETIC_HEAD_FILE", "build_tiny_clip"]

AESTHETIC_HEAD_FILE = "aesthetic_head.safetensors"
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# LAION's hidden sizes after the 768-wide input: 1024, 128, 64, 16, 1.
_HEAD_WIDTHS = (1024, 128, 64, 16, 1)


def build_tiny_clip(out_dir: str | Path, seed: int = 0, projection_dim: int = 16, image_size: int = 32) -> Path:
    """Write a tiny random CLIP model + processor + aesthetic head to `out_dir`; returns the folder."""
    from safetensors.torch import save_file
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from omni_core.models.tiny import build_clip_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_clip_tokenizer()
    config = CLIPConfig(
        projection_dim=projection_dim,
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "max_position_embeddings": 77,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "image_size": image_size,
            "patch_size": 8,
        },
    )
    torch.manual_seed(seed)
    CLIPModel(config).save_pretrained(out)
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": image_size},
        crop_size={"height": image_size, "width": image_size},
        image_mean=_CLIP_MEAN,
        image_std=_CLIP_STD,
    )
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(out)

    generator = torch.Generator().manual_seed(seed + 1)
    widths = (projection_dim, *_HEAD_WIDTHS)
    head = {}
    for index, (n_in, n_out) in zip((0, 2, 4, 6, 7), zip(widths, widths[1:], strict=False), strict=True):
        bound = n_in**-0.5  # nn.Linear's default init range
        head[f"layers.{index}.weight"] = (torch.rand(n_out, n_in, generator=generator) * 2 - 1) * bound
        head[f"layers.{index}.bias"] = (torch.rand(n_out, generator=generator) * 2 - 1) * bound
    save_file(head, str(out / AESTHETIC_HEAD_FILE))
    return out
