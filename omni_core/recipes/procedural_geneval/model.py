"""The procedural benchmark's model: a pixel-space SD3 pipeline, built offline with random weights.

Why pixel space: the scenes are 32 x 32 RGB images of flat colours, small enough for the transformer to denoise
pixels directly (patch 4: 64 image tokens), so no VAE has to be trained first, nothing blurs the colours the
verifier reads, and decoding is exact. It is still a real `StableDiffusion3Pipeline` saved with `save_pretrained`:
`model_index.json` lists `vae`, `text_encoder_3` and `tokenizer_3` as absent (`[null, null]`), the transformer has
3 input and output channels, and `load_pipeline` / `arch.PixelSD3Adapter` read it like any SD3 folder (the SDE
rollout, log-probs, training and export are the SD3 code paths; `decode` maps [-1, 1] to uint8).

- `tokenizer` / `tokenizer_2`: a real `CLIPTokenizer` whose BPE merges make every word of the scene prompts one
  token (a prompt is at most 12 tokens with its start and end tokens; `model_max_length` 16).
- `text_encoder` / `text_encoder_2`: `CLIPTextModelWithProjection` hidden 32, 2 layers, 4 heads: random and frozen,
  as text encoders are in SD3 fine-tuning; the transformer learns to read their features.
- `transformer`: `SD3Transformer2DModel` patch 4, 3 channels, 4 joint blocks, 4 heads x 32 (2.3 M parameters).
- `scheduler`: `FlowMatchEulerDiscreteScheduler(shift=1.0)` (the rectified-flow schedule the model is trained on).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

from omni_core.recipes.procedural_geneval.scenes import all_scenes

__all__ = ["IMAGE_SIZE", "build_procedural_pipeline", "build_scene_tokenizer"]

IMAGE_SIZE = 32
MAX_TOKENS = 16
CLIP_HIDDEN = 32
_END = "</w>"


def _words() -> list[str]:
    return sorted({word for scene in all_scenes() for word in scene.prompt.split()})


def _bpe(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Byte-pair encoding of one word as CLIP's tokenizer does it: merge the best-ranked adjacent pair until none is ranked."""
    while len(symbols) > 1:
        pairs = [(ranks.get((a, b)), i) for i, (a, b) in enumerate(zip(symbols, symbols[1:], strict=False))]
        ranked = [(r, i) for r, i in pairs if r is not None]
        if not ranked:
            break
        _, i = min(ranked)
        symbols = [*symbols[:i], symbols[i] + symbols[i + 1], *symbols[i + 2 :]]
    return symbols


def _word_merges(words: list[str]) -> list[tuple[str, str]]:
    """Merges that make each word one token. A word's next merge joins the first pair of its segmentation under the
    merges so far, appended at the lowest rank: the words already merged have no pair left for it to break."""
    merges: list[tuple[str, str]] = []
    for word in words:
        while len(symbols := _bpe([*word[:-1], word[-1] + _END], {m: r for r, m in enumerate(merges)})) > 1:
            merges.append((symbols[0], symbols[1]))
    return merges


def build_scene_tokenizer() -> CLIPTokenizer:
    """A real `CLIPTokenizer` whose vocabulary is the scene prompts' letters and words (each word one token)."""
    words = _words()
    letters = sorted({c for w in words for c in w})
    vocab = {s: i for i, s in enumerate([*letters, *(c + _END for c in letters)])}
    merges = _word_merges(words)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "vocab.json").write_text(json.dumps(vocab))
        (Path(tmp) / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
        tokenizer = CLIPTokenizer(
            str(Path(tmp) / "vocab.json"), str(Path(tmp) / "merges.txt"), model_max_length=MAX_TOKENS, pad_token="<|endoftext|>"
        )
    for word in words:
        if len(tokenizer.tokenize(word)) != 1:
            raise AssertionError(f"the scene tokenizer splits {word!r}: {tokenizer.tokenize(word)}")
    return tokenizer


def _text_encoder(tokenizer: CLIPTokenizer) -> CLIPTextModelWithProjection:
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=CLIP_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,  # SD3 reads hidden_states[-2]
        num_attention_heads=4,
        max_position_embeddings=MAX_TOKENS,
        projection_dim=CLIP_HIDDEN,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    encoder = CLIPTextModelWithProjection(config)
    # Unit-scale word embeddings (CLIP initialises them at std 0.02): the frozen encoder's features then reach the
    # transformer at the scale of a trained encoder's, instead of ~50x smaller (one run each, 600 supervised steps:
    # colour 77% / position 66% with these, 50% / 37% with CLIP's initialisation).
    torch.nn.init.normal_(encoder.text_model.embeddings.token_embedding.weight, std=1.0)
    return encoder


def build_procedural_pipeline(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the random-weight pixel-space SD3 pipeline to `out_dir` (`load_pipeline` reads it back); returns the folder.

    The global torch RNG is reseeded per component (`seed + k`) and restored afterwards."""
    rng_state = torch.random.get_rng_state()
    try:
        tokenizer = build_scene_tokenizer()
        torch.manual_seed(seed)
        text_encoder = _text_encoder(tokenizer)
        torch.manual_seed(seed + 1)
        text_encoder_2 = _text_encoder(tokenizer)
        torch.manual_seed(seed + 2)
        transformer = SD3Transformer2DModel(
            sample_size=IMAGE_SIZE,
            patch_size=4,
            in_channels=3,
            out_channels=3,
            num_layers=4,
            attention_head_dim=32,
            num_attention_heads=4,
            joint_attention_dim=2 * CLIP_HIDDEN,  # SD3 concatenates the two CLIP hidden states
            caption_projection_dim=128,
            pooled_projection_dim=2 * CLIP_HIDDEN,
            pos_embed_max_size=IMAGE_SIZE // 4,
        )
    finally:
        torch.random.set_rng_state(rng_state)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0),
        vae=None,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=build_scene_tokenizer(),
        text_encoder_3=None,
        tokenizer_3=None,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    return out
