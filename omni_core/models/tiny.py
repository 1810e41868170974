"""Tiny random-weight diffusers pipelines, built fully offline, for tests and CPU benchmarks.

This module owns the dimensions of OmniFlow's tiny models. Every component is created from a config
(no hub download), every tokenizer is built in memory and saved as real tokenizer files, and the
whole pipeline is written with ``save_pretrained`` so that it is loaded back through the same
``from_pretrained`` path a real model uses (``omni_core.models.loader.load_pipeline``).

Tiny SD3 (``arch="sd3"``, ``StableDiffusion3Pipeline``), ~2.3 M transformer parameters:

- ``tokenizer`` / ``tokenizer_2``: ``CLIPTokenizer`` (byte-level, one token per character, 514 tokens,
  77 max length); ``tokenizer_3``: ``T5Tokenizer`` (in-memory Unigram, a few hundred pieces).
- ``text_encoder`` / ``text_encoder_2``: ``CLIPTextModelWithProjection`` hidden 32, 2 layers,
  4 heads, projection 32.
- ``text_encoder_3``: ``T5EncoderModel`` d_model 64, 2 layers, 2 heads x 32.
- ``transformer``: ``SD3Transformer2DModel`` 4 layers, 4 heads x 32 head dim (inner 128), patch 2,
  16 latent channels, ``joint_attention_dim`` 64 (== T5 d_model) and ``pooled_projection_dim`` 64
  (== 2 x CLIP projection) -- SD3's ``encode_prompt`` pads the concatenated CLIP hiddens (2 x 32) to
  the T5 width, and silently crops if they were wider.
- ``vae``: ``AutoencoderKL`` with 2 blocks (8, 16 channels), scale factor 2, 16 latent channels.
- ``scheduler``: ``FlowMatchEulerDiscreteScheduler(shift=3.0)``.

A 64x64 image has 16x32x32 latents, i.e. 256 image tokens after patchify.

Tiny FLUX (``arch="flux"``, ``FluxPipeline``): ``CLIPTextModel`` hidden 32 (pooled 32) +
``T5EncoderModel`` d_model 64; ``FluxTransformer2DModel`` 1 double + 2 single blocks, 4 heads x 32,
RoPE axes (8, 12, 12), guidance embedding on (FLUX.1-dev style), 64 packed channels (16 x 2 x 2);
the same VAE family (16 latent channels, scale factor 2; 64 px -> 256 packed tokens of 64 channels);
``FlowMatchEulerDiscreteScheduler`` with resolution-dependent (dynamic) shifting.

Tiny Qwen-Image (``arch="qwen-image"``, ``QwenImagePipeline``), ~1.3 M transformer parameters:

- ``tokenizer``: ``Qwen2Tokenizer`` (byte-level BPE, ~370 tokens) whose merges make every word of the
  pipeline's prompt template one token, so the template's system part is 34 tokens, as with the real Qwen
  tokenizer, and the pipeline's ``prompt_template_encode_start_idx = 34`` drops exactly that part; the chat
  special tokens ``<|im_start|>`` / ``<|im_end|>``; ``<|endoftext|>`` pads.
- ``text_encoder``: ``Qwen2_5_VLForConditionalGeneration`` hidden 32, 2 layers, 2 heads (1 KV head), mrope
  sections (2, 3, 3); a 1-block vision tower that text-to-image never calls.
- ``transformer``: ``QwenImageTransformer2DModel`` 2 layers, 4 heads x 32, RoPE axes (8, 12, 12), patch 2,
  64 packed channels (16 x 2 x 2), ``joint_attention_dim`` 32 (== the text hidden size).
- ``vae``: ``AutoencoderKLQwenImage`` base 8 channels, one downsampling (scale factor 2), ``z_dim`` 16 with
  Qwen-Image's published ``latents_mean`` / ``latents_std``; 32 px -> 64 packed tokens of 64 channels.
- ``scheduler``: Qwen-Image's published ``FlowMatchEulerDiscreteScheduler`` config (exponential dynamic
  shift, base 0.5 / max 0.9 over 256..8192 tokens, ``shift_terminal`` 0.02).

Determinism: ``torch.manual_seed(seed + k)`` before the k-th component, so the same seed gives
bit-identical weights whatever was built before.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from tokenizers import AddedToken
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

from omni_core.models.architectures import ARCHITECTURES
from omni_core.quiet import quiet_model_libraries

quiet_model_libraries()  # no progress bars while writing the tiny model

CLIP_HIDDEN = 32
T5_D_MODEL = 64
QWEN_TEXT_HIDDEN = 32
LATENT_CHANNELS = 16

# A few words so that the T5 Unigram tokenizer produces whole-word pieces for typical test prompts;
# anything else falls back to single characters (every letter and digit is in the vocab).
_T5_WORDS = (
    "a an the of on in with and photo image picture red green blue yellow white black cat dog "
    "circle square triangle background small large one two three four"
).split()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP byte -> printable unicode map (the byte-level alphabet of CLIP's BPE)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, codes, strict=True)}


def build_clip_tokenizer() -> CLIPTokenizer:
    """A real ``CLIPTokenizer`` over the 256 byte symbols and their end-of-word forms (514 tokens).

    No merges: each character is one token, which is all a random-weight text encoder needs.
    """
    symbols = list(_bytes_to_unicode().values())
    vocab = {s: i for i, s in enumerate(symbols + [s + "</w>" for s in symbols])}
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def build_t5_tokenizer() -> T5Tokenizer:
    """A real ``T5Tokenizer`` from an in-memory Unigram vocab (pad 0, eos 1, unk 2 as in T5)."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    chars = "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-"
    pieces += [(c, -5.0) for c in chars] + [("▁" + c, -5.5) for c in chars]
    # Whole words score better than their spelled-out characters, so Unigram prefers them.
    pieces += [("▁" + w, -3.0) for w in _T5_WORDS]
    return T5Tokenizer(vocab=pieces, extra_ids=100, model_max_length=512)


# QwenImagePipeline's prompt template, read from the class (its system part is dropped after encoding).
_QWEN_TEMPLATE_WORDS = ("system", "user", "assistant", "Describe")
_QWEN_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>")


def build_qwen2_tokenizer() -> Qwen2Tokenizer:
    """A real ``Qwen2Tokenizer`` (byte-level BPE with Qwen2's pre-tokenizer) over the 256 byte symbols, with merges
    that make each word of QwenImagePipeline's prompt template (and of a few test words) a single token.

    Each word's merges are spelled out left to right (``Ġ t`` -> ``Ġt``, ``Ġt h`` -> ``Ġth``, ...), so the vocab is
    the byte alphabet plus those prefixes; ``<|endoftext|>`` (id 0) pads and ends, the chat tokens are special.
    """
    byte_symbols = _bytes_to_unicode()
    symbols, space = list(byte_symbols.values()), byte_symbols[ord(" ")]  # "Ġ": byte-level BPE's leading space
    template = QwenImagePipeline.__init__.__code__.co_consts  # the template is a literal of the constructor
    text = next(c for c in template if isinstance(c, str) and c.startswith("<|im_start|>system"))
    words = [w.strip(",:") for w in text.split("\n")[1].split("<|im_end|>")[0].split(" ")]
    vocab = {"<|endoftext|>": 0}
    vocab.update((s, i + 1) for i, s in enumerate(symbols))
    merges: list[tuple[str, str]] = []
    for word in [*_QWEN_TEMPLATE_WORDS, *(space + w for w in words[1:] + list(_T5_WORDS))]:
        for end in range(2, len(word) + 1):
            if word[:end] not in vocab:
                merges.append((word[: end - 1], word[end - 1]))
                vocab[word[:end]] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=2048)
    tokenizer.add_tokens([AddedToken(t, special=True) for t in _QWEN_SPECIAL_TOKENS], special_tokens=True)
    return tokenizer


def _clip_config(vocab_size: int, tokenizer: CLIPTokenizer) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=CLIP_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,  # SD3 reads hidden_states[-2]: needs at least 2 layers
        num_attention_heads=4,
        max_position_embeddings=77,
        projection_dim=CLIP_HIDDEN,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _t5_encoder(vocab_size: int) -> T5EncoderModel:
    config = T5Config(
        vocab_size=vocab_size,
        d_model=T5_D_MODEL,
        d_ff=128,
        d_kv=32,
        num_layers=2,
        num_heads=2,
        decoder_start_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
        feed_forward_proj="gated-gelu",
    )
    return T5EncoderModel(config)


VAE_SCALE_FACTORS = (2, 4, 8)  # the tiny VAEs' (2: the default; 8: the real models', for a recipe's resolution)


def _downsamplings(vae_scale_factor: int) -> int:
    if vae_scale_factor not in VAE_SCALE_FACTORS:
        raise ValueError(f"vae_scale_factor={vae_scale_factor}: choose one of {list(VAE_SCALE_FACTORS)}")
    return vae_scale_factor.bit_length() - 1


def _vae(shift_factor: float, scaling_factor: float, vae_scale_factor: int = 2) -> AutoencoderKL:
    blocks = _downsamplings(vae_scale_factor) + 1
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        block_out_channels=(8, *[16] * (blocks - 1)),  # n blocks -> vae_scale_factor 2 ** (n - 1)
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=4,
        sample_size=64,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=shift_factor,
        scaling_factor=scaling_factor,
    )


def qwen_text_encoder(tokenizer: Qwen2Tokenizer, hidden: int = QWEN_TEXT_HIDDEN) -> Qwen2_5_VLForConditionalGeneration:
    """A 2-layer Qwen2.5-VL of width ``hidden`` (a multiple of 16: heads of 16 dims, one KV head)."""
    head_dim = 16
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": hidden // head_dim,
            "num_key_value_heads": 1,
            "max_position_embeddings": 2048,
            # Qwen2.5-VL's multimodal RoPE: temporal / height / width sections of the head_dim / 2 frequencies.
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
            "bos_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": hidden,
            "fullatt_block_indexes": [0],
        },
    )
    assert head_dim // 2 == sum(config.text_config.rope_parameters["mrope_section"])
    return Qwen2_5_VLForConditionalGeneration(config)


def _seeded(seed: int, k: int) -> None:
    # Re-seed before each component: its weights then depend on (seed, k) only.
    torch.manual_seed(seed + k)


def tiny_sd3(seed: int, max_image_size: int | None = None, vae_scale_factor: int = 2) -> StableDiffusion3Pipeline:
    """The tiny SD3 pipeline of the module docstring, in memory (``ARCHITECTURES``' ``tiny_builder``). Its position
    table covers 32 patches a side (128 px with the default VAE); ``max_image_size`` (px) makes it cover that side
    instead (a recipe's resolution: the table is a buffer, the trained weights are the same)."""
    clip_tok = build_clip_tokenizer()
    t5_tok = build_t5_tokenizer()
    _seeded(seed, 0)
    text_encoder = CLIPTextModelWithProjection(_clip_config(len(clip_tok), clip_tok))
    _seeded(seed, 1)
    text_encoder_2 = CLIPTextModelWithProjection(_clip_config(len(clip_tok), clip_tok))
    _seeded(seed, 2)
    text_encoder_3 = _t5_encoder(len(t5_tok))
    _seeded(seed, 3)
    transformer = SD3Transformer2DModel(
        sample_size=32,
        patch_size=2,
        in_channels=LATENT_CHANNELS,
        num_layers=4,
        attention_head_dim=32,
        num_attention_heads=4,
        joint_attention_dim=T5_D_MODEL,
        caption_projection_dim=128,
        pooled_projection_dim=2 * CLIP_HIDDEN,
        out_channels=LATENT_CHANNELS,
        pos_embed_max_size=32 if max_image_size is None else max(32, -(-max_image_size // (2 * vae_scale_factor))),
    )
    _seeded(seed, 4)
    vae = _vae(shift_factor=0.0609, scaling_factor=1.5035, vae_scale_factor=vae_scale_factor)  # SD3's VAE constants
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tok,
        text_encoder_2=text_encoder_2,
        tokenizer_2=build_clip_tokenizer(),
        text_encoder_3=text_encoder_3,
        tokenizer_3=t5_tok,
    )


def tiny_flux(seed: int, vae_scale_factor: int = 2) -> FluxPipeline:
    """The tiny FLUX pipeline of the module docstring, in memory (``ARCHITECTURES``' ``tiny_builder``)."""
    clip_tok = build_clip_tokenizer()
    t5_tok = build_t5_tokenizer()
    _seeded(seed, 0)
    text_encoder = CLIPTextModel(_clip_config(len(clip_tok), clip_tok))
    _seeded(seed, 1)
    text_encoder_2 = _t5_encoder(len(t5_tok))
    _seeded(seed, 2)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=LATENT_CHANNELS * 4,  # FLUX packs 2x2 latent patches into channels
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=32,
        num_attention_heads=4,
        joint_attention_dim=T5_D_MODEL,
        pooled_projection_dim=CLIP_HIDDEN,  # CLIPTextModel pooler output
        guidance_embeds=True,
        axes_dims_rope=(8, 12, 12),  # must sum to attention_head_dim
    )
    _seeded(seed, 3)
    vae = _vae(shift_factor=0.1159, scaling_factor=0.3611, vae_scale_factor=vae_scale_factor)  # FLUX's VAE constants
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return FluxPipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tok,
        text_encoder_2=text_encoder_2,
        tokenizer_2=t5_tok,
    )


def tiny_qwen_image(seed: int, vae_scale_factor: int = 2) -> QwenImagePipeline:
    """The tiny Qwen-Image pipeline of the module docstring, in memory (``ARCHITECTURES``' ``tiny_builder``)."""
    tokenizer = build_qwen2_tokenizer()
    _seeded(seed, 0)
    text_encoder = qwen_text_encoder(tokenizer)
    _seeded(seed, 1)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=LATENT_CHANNELS * 4,  # 2x2 latent patches packed into channels
        out_channels=LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=32,
        num_attention_heads=4,
        joint_attention_dim=QWEN_TEXT_HIDDEN,
        axes_dims_rope=(8, 12, 12),  # frame, height, width: sums to attention_head_dim
    )
    _seeded(seed, 2)
    downs = _downsamplings(vae_scale_factor)
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, *[2] * downs], num_res_blocks=1, temperal_downsample=[False] * downs
    )  # vae_scale_factor 2 ** len(temperal_downsample); latents_mean / latents_std: Qwen-Image's
    scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen/Qwen-Image scheduler_config.json
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )
    return QwenImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )


def build_tiny_pipeline(
    out_dir: str | Path, arch: str = "sd3", seed: int = 0, max_image_size: int | None = None, vae_scale_factor: int = 2
) -> Path:
    """Build a tiny random-weight pipeline of ``arch`` (a name of ``ARCHITECTURES``) and save it to ``out_dir``.
    ``max_image_size``: the largest image side (px) it must sample, for an architecture with a position table (SD3's
    128 px by default; FLUX and Qwen-Image have rotary positions and no maximum). ``vae_scale_factor``: 2 (the
    default: small images stay cheap to test) or 8, the real models' (an image has the real model's token count, as a
    recipe's resolution needs).

    Returns the directory, which ``load_pipeline`` (or ``<Pipeline>.from_pretrained``) reads back.
    Dimensions are listed in the module docstring. The global torch RNG is reseeded while building
    and restored afterwards, so building a model does not perturb the caller's random stream.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch={arch!r} is not a tiny architecture; choose one of {list(ARCHITECTURES)}")
    options: dict[str, int] = {"vae_scale_factor": vae_scale_factor} if vae_scale_factor != 2 else {}
    if max_image_size is not None:
        if ARCHITECTURES[arch].size_rule != "patch_embed":
            raise ValueError(f"max_image_size: the tiny {arch} has rotary positions and samples any size; leave it unset")
        options["max_image_size"] = max_image_size
    out = Path(out_dir)
    rng_state = torch.random.get_rng_state()
    try:
        pipe = ARCHITECTURES[arch].build_tiny(seed, **options)
    finally:
        torch.random.set_rng_state(rng_state)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    return out
