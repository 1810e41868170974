"""Prompt embeddings computed once per prompt set, so that the text encoders stay off the device afterwards.

Owns the file that holds them: one safetensors file (never pickle) with one tensor per cond key of the
architecture per unique prompt text, ``<key>.<name>`` (``key = prompt_key(text)``; SD3 / FLUX
``prompt_embeds [L, D]`` and ``pooled_prompt_embeds [P]``, Qwen-Image ``prompt_embeds [L, D]`` and
``prompt_embeds_mask [L]``), and metadata (architecture, cond keys, max_sequence_length, text-encoder
fingerprint, count, dtype, device). It
owns writing that file from a pipeline's text encoders and tokenizers alone (``encode_prompt_set``) and
reading it back, memory-mapped, as the cond dict ``FlowPolicy.encode_prompts`` returns
(``PromptEmbeddings.cond``).

Each prompt is encoded alone (a batch of one) with the architecture adapter's own ``encode`` call, so its
embedding does not depend on which prompts shared a batch and equals a fresh single-prompt
``FlowPolicy.encode_prompts`` bit for bit on the same device. The empty string is always included: it
is the negative prompt of classifier-free guidance when none is given.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from omni_core.cache_keys import key_of
from omni_core.data.prompts import PromptRecord
from omni_core.models.hub import model_folder, resolve_model_path
from omni_core.models.model_index import read_model_index

if TYPE_CHECKING:
    from omni_core.models.arch import ArchAdapter

FORMAT = "omniflow-prompt-embeddings/1"
# The cond keys of a file written before the metadata named them (SD3 / FLUX).
DEFAULT_COND_KEYS = ("prompt_embeds", "pooled_prompt_embeds")
# The pipeline components that turn text into embeddings (SD3: three encoders, FLUX: two, Qwen-Image: one).
TEXT_COMPONENT_PREFIXES = ("text_encoder", "tokenizer")


class PromptNotEmbeddedError(KeyError):
    """A prompt that is not in the prompt-embeddings file; the message names the prompt and the file."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


def prompt_key(text: str) -> str:
    """Stable key of one prompt text: the first 32 hex digits (128 bits) of the sha256 of its UTF-8 bytes."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def text_component_dirs(model_path: str | Path) -> list[Path]:
    """The text-encoder and tokenizer folders of a saved pipeline (those ``model_index.json`` lists), sorted."""
    path = Path(model_path).expanduser()
    index = read_model_index(path)
    names = [
        name
        for name, value in index.items()
        if name.startswith(TEXT_COMPONENT_PREFIXES) and isinstance(value, list) and value[0] is not None
    ]
    return [path / name for name in sorted(names)]


@functools.lru_cache(maxsize=4096)
def _file_digest(path: str, size: int, mtime_ns: int) -> bytes:
    # Keyed by (size, mtime) too, so an edited file is hashed again; a T5-XXL is hashed once per process.
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(functools.partial(f.read, 1 << 24), b""):
            h.update(block)
    return h.digest()


def text_encoder_fingerprint(model_path: str | Path) -> str:
    """sha256 over (component/relative name, sha256 of bytes) of every text-encoder and tokenizer file.

    What the embeddings depend on in the model folder; the transformer, VAE and scheduler are left out,
    so fine-tuned checkpoints of one base model share a fingerprint.
    """
    root = Path(model_path).expanduser()
    h = hashlib.sha256()
    for folder in text_component_dirs(root):
        for f in sorted(p for p in folder.rglob("*") if p.is_file()):
            stat = f.stat()
            h.update(f.relative_to(root).as_posix().encode())
            h.update(_file_digest(str(f.resolve()), stat.st_size, stat.st_mtime_ns))
    return h.hexdigest()


def unique_prompts(prompts: Sequence[str]) -> list[str]:
    """The sorted unique texts of ``prompts`` plus ``""`` (the default CFG negative)."""
    return sorted({*prompts, ""})


def prompt_set(train: Sequence[PromptRecord], val: Sequence[PromptRecord]) -> list[str]:
    """Every text a run encodes: prompts and negative prompts of both splits, plus "" (sorted, unique)."""
    return unique_prompts([t for r in (*train, *val) for t in (r.prompt, r.negative_prompt or "")])


def embeddings_key(actor_rollout_ref: Any, device: str, prompts: list[str]) -> str:
    """The cache key of a run's prompt embeddings (`actor_rollout_ref`: that config section): the text encoders'
    files, the architecture, the token length, the device and the prompt set."""
    model = actor_rollout_ref.model
    fields = {
        # the resolved folder's files (a Hub id: its revision's snapshot), hashed once per process (memoised by size + mtime)
        "text_encoders": text_encoder_fingerprint(model_folder(model)),
        "architecture": model.architecture,
        "max_sequence_length": actor_rollout_ref.rollout.pipeline.max_sequence_length,
        "device": device,
        "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
    }
    return key_of("prompt-embeddings", [], fields)


def _text_only_adapter(model_path: Path, architecture: str | None, device: str, torch_dtype: torch.dtype) -> ArchAdapter:
    # diffusers only here: the flow process that finds the embeddings cached never imports it (~2 s on 2 cores).
    from omni_core.models.architectures import BY_PIPELINE
    from omni_core.models.loader import ModelLoadError, absent_components, check_pipeline_folder

    name = check_pipeline_folder(model_path, architecture)
    entry = BY_PIPELINE[name]
    try:
        pipe = entry.pipeline_cls().from_pretrained(
            model_path,
            **(absent_components(model_path) | {"transformer": None, "vae": None}),
            dtype=torch_dtype,
            local_files_only=True,
        )
    except Exception as err:  # corrupt safetensors, bad configs, ...: one error type naming the path
        raise ModelLoadError(f"{model_path}: failed to load the text encoders of {name}: {type(err).__name__}: {err}") from err
    if name == "StableDiffusion3Pipeline" and getattr(pipe, "text_encoder_3", None) is None:
        # Without T5, SD3's encode_prompt pads with zeros as wide as the transformer's joint_attention_dim: the
        # transformer's config is all it reads, so the config stands in for the (unloaded) weights.
        from types import SimpleNamespace

        from diffusers.configuration_utils import FrozenDict

        config = json.loads((Path(model_path) / "transformer" / "config.json").read_text())
        object.__setattr__(pipe, "transformer", SimpleNamespace(config=FrozenDict(config)))
    pipe = pipe.to(device)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.requires_grad_(False).eval()
    # encode() needs only the pipeline's text side: the same adapter (and encode) that policies use.
    return entry.adapter_cls()(pipe)


@torch.no_grad()
def encode_prompt_set(
    model_path: str | Path,
    prompts: Sequence[str],
    max_sequence_length: int,
    out_file: str | Path,
    device: str | torch.device = "cpu",
    architecture: str | None = None,
    *,
    torch_dtype: torch.dtype = torch.float32,
    revision: str | None = None,
) -> Path:
    """Encode every unique text of ``prompts`` (and ``""``) with the pipeline's text encoders; write ``out_file``.

    Loads only the text encoders and tokenizers of the pipeline in ``model_path`` (no transformer, no
    VAE; a Hub id at ``revision`` is read from the Hugging Face cache), in ``torch_dtype`` on ``device``; each text is encoded alone with the architecture adapter's
    ``encode`` (what ``FlowPolicy.encode_prompts`` calls). The file is written atomically (a temporary
    file in the same folder, then ``os.replace``) and its path returned.
    """
    model_path = resolve_model_path(model_path, revision)  # a Hub id: its snapshot folder in the Hugging Face cache
    out_file = Path(out_file)
    adapter = _text_only_adapter(model_path, architecture, str(device), torch_dtype)
    texts = unique_prompts(prompts)
    tensors: dict[str, torch.Tensor] = {}
    for text in texts:
        cond = adapter.encode([text], None, max_sequence_length, False, torch.device(device))
        key = prompt_key(text)
        for name in adapter.cond_keys:
            tensors[f"{key}.{name}"] = cond[name][0].contiguous().cpu()
    metadata = {
        "format": FORMAT,
        "architecture": type(adapter.pipe).__name__,
        "cond_keys": ",".join(adapter.cond_keys),
        "max_sequence_length": str(max_sequence_length),
        "text_encoder_fingerprint": text_encoder_fingerprint(model_path),
        "count": str(len(texts)),
        "dtype": str(torch_dtype).removeprefix("torch."),
        "device": torch.device(device).type,
    }
    return save_file_atomically(tensors, out_file, metadata)


def save_file_atomically(tensors: dict[str, torch.Tensor], out_file: Path, metadata: dict[str, str]) -> Path:
    """Write a safetensors file the way every cached set-up file is written: a temporary file in the same folder,
    then `os.replace`, so a reader never sees half a file. Returns `out_file`."""
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_name(f".{out_file.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, out_file)
    finally:
        tmp.unlink(missing_ok=True)
    return out_file


class PromptEmbeddings:
    """The prompt embeddings of a run, read lazily from the file ``encode_prompt_set`` wrote.

    The file is memory-mapped on first use and only the requested rows are read. Picklable (the path
    travels, the open handle does not), so it can be handed to Ray actors.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = None
        self._keys: frozenset[str] | None = None
        self._metadata: dict[str, str] | None = None

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])

    def _open(self):
        if self._file is None:
            if not self.path.is_file():
                raise FileNotFoundError(f"prompt-embeddings file {self.path} does not exist; run prepare_prompt_embeddings again")
            self._file = safe_open(str(self.path), framework="pt", device="cpu")
            self._keys = frozenset(self._file.keys())
            self._metadata = dict(self._file.metadata() or {})
        return self._file

    @property
    def metadata(self) -> dict[str, str]:
        self._open()
        return self._metadata

    @property
    def max_sequence_length(self) -> int:
        return int(self.metadata["max_sequence_length"])

    @property
    def architecture(self) -> str:
        return self.metadata["architecture"]

    @property
    def cond_keys(self) -> tuple[str, ...]:
        """The tensors stored per prompt (the architecture adapter's ``cond_keys``)."""
        names = self.metadata.get("cond_keys")
        return tuple(names.split(",")) if names else DEFAULT_COND_KEYS

    def __len__(self) -> int:
        return int(self.metadata["count"])

    def __contains__(self, text: object) -> bool:
        self._open()
        return isinstance(text, str) and f"{prompt_key(text)}.prompt_embeds" in self._keys

    def _rows(self, texts: Sequence[str], name: str) -> torch.Tensor:
        f = self._open()
        rows = []
        for text in texts:
            if text not in self:
                raise PromptNotEmbeddedError(
                    f"prompt {text!r} is not in {self.path}: the prompt embeddings were computed for the run's prompt "
                    f"set (train and validation prompts, their negative prompts, and ''); encode new prompts with "
                    f"omni_core.models.prompt_embeddings.encode_prompt_set (the prepare_prompt_embeddings task)"
                )
            rows.append(f.get_tensor(f"{prompt_key(text)}.{name}"))
        return torch.stack(rows)

    def cond(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str] | None,
        do_cfg: bool,
        device: str | torch.device,
        dtype: torch.dtype | None = None,
    ) -> dict[str, torch.Tensor]:
        """The cond dict of ``FlowPolicy.encode_prompts(prompts, negative_prompts, max_sequence_length, do_cfg)``:
        ``prompt_embeds [B, L, D]``, ``pooled_prompt_embeds [B, P]`` (the file's ``cond_keys``) and, with ``do_cfg``, the same keys
        prefixed ``negative_`` (``""`` negatives when ``negative_prompts`` is None). ``dtype`` None keeps
        the dtype the encoders produced."""
        prompts = list(prompts)
        if negative_prompts is not None and len(negative_prompts) != len(prompts):
            raise ValueError(f"{len(negative_prompts)} negative prompts for {len(prompts)} prompts")
        groups = {"": prompts}
        if do_cfg:
            groups["negative_"] = list(negative_prompts) if negative_prompts is not None else [""] * len(prompts)
        cond = {}
        for prefix, texts in groups.items():
            for name in self.cond_keys:
                cond[prefix + name] = self._rows(texts, name).to(device=device, dtype=dtype)
        return cond
