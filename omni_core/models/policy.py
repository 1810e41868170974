"""``FlowPolicy``: a loaded diffusers pipeline seen as an RL policy over denoising steps.

Owns the trainable transformer (full fine-tuning or peft LoRA), the reference policy (LoRA disabled, or a
lazily made frozen copy), the attention backend and gradient checkpointing switches, prompt encoding
into a row-sliceable "cond" dict, one velocity forward (with batched CFG), latent noise, the timestep
schedule, decoding to uint8 images, and saving / loading what is trained. Architecture details live in
``omni_core.models.arch``; the SDE math in ``omni_core.sde``; the rollout loop in ``omni_core.rollout``.

Placement and precision: every module sits on ``device``; weights are loaded in ``dtype`` (the rollout
copy in ``actor_rollout_ref.rollout.dtype``; the trained copy in ``actor.fsdp_config.model_dtype``), and
trained parameters are always fp32 (full fine-tuning needs an fp32 model; LoRA adapters are upcast on a
bf16/fp16 base). ``compute_dtype`` runs the transformer forward under ``torch.autocast`` (mixed precision,
``actor.fsdp_config.dtype``); the velocity comes back fp32, so the SDE step and log-probs stay fp32.
Prompts are embedded by the text encoders, or looked up in a ``PromptEmbeddings`` file computed once per
prompt set (then the text encoders need not be loaded at all: ``text_encoders=False``).

``enable_torch_compile`` (``actor.use_torch_compile`` / ``rollout.use_torch_compile``) runs every transformer
forward of ``velocity`` through ``torch.compile`` from then on: the trained transformer (peft-wrapped under
LoRA), the module ``forward_through`` names (DDP) and the frozen reference copy, each wrapped once and sharing
its parameters with the eager module (weights loaded later are seen). ``dynamic=False``: one graph per input
shape, grad mode and train / eval mode (Dynamo's guards), the inputs made contiguous first so that a strided
view (a window step of stored latents) and a fresh tensor of the same shape share a graph.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn as nn

from omni_core.models import lora
from omni_core.models.arch import adapter_for
from omni_core.models.hub import TRANSFORMERS_SKIP, resolve_model_path
from omni_core.models.loader import load_pipeline
from omni_core.models.model_index import config_differences
from omni_core.sde import Generators, randn_per_sample

# Graphs Dynamo may keep per compiled code object before it falls back to eager for good (its default, 8, can be
# reached: the forward of one transformer class serves rollout, old log-prob, update, reference and validation
# batches, each a shape x grad mode x train/eval mode x LoRA adapters on/off).
COMPILE_RECOMPILE_LIMIT = 64


class FlowPolicy:
    """A text-to-image flow-matching policy: the pipeline's transformer is the only trained module.

    ``lora_rank=0`` means full fine-tuning. ``target_modules`` is a list of module names or
    ``"all-linear"``. ``lora_adapter_path`` attaches an existing adapter (diffusers LoRA file or peft dir)
    instead of a fresh one. ``attn_backend`` is a diffusers attention-dispatcher backend name (``"native"``
    = torch SDPA); transformers whose processors do not go through the dispatcher (SD3 in diffusers 0.42)
    keep torch SDPA whatever the name.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        architecture: str | None = None,
        lora_rank: int = 0,
        lora_alpha: float | None = None,
        lora_init_weights: str | bool = "gaussian",
        target_modules: list[str] | str = "all-linear",
        lora_adapter_path: str | Path | None = None,
        enable_gradient_checkpointing: bool = False,
        attn_backend: str = "native",
        dtype: torch.dtype = torch.float32,
        compute_dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        text_encoders: bool = True,
        trainable: bool = True,
        prompt_embeddings: str | Path | None = None,
        revision: str | None = None,
    ):
        self.device = torch.device(device)
        self.dtype = dtype
        self._forward_module: torch.nn.Module | None = None  # see `forward_through`
        self.torch_compile, self._compile_options = False, {}  # see `enable_torch_compile`
        # role ("trained", "wrapped": forward_through's, "reference") -> (the eager module, its torch.compile wrapper)
        self._compiled: dict[str, tuple[nn.Module, nn.Module]] = {}
        self.compute_dtype = compute_dtype if compute_dtype not in (None, dtype) else None
        is_lora = bool(lora_rank or lora_adapter_path)
        if trainable and not is_lora and dtype != torch.float32:
            raise ValueError(f"full fine-tuning keeps fp32 master weights: dtype={dtype} needs LoRA (lora_rank > 0) or float32")
        loader_kwargs = {} if text_encoders else {"text_encoders": False}
        self.pipeline = load_pipeline(path, architecture, torch_dtype=dtype, revision=revision, **loader_kwargs).to(self.device)
        self.prompt_embeddings = None
        if prompt_embeddings is not None:
            from omni_core.models.prompt_embeddings import PromptEmbeddings

            self.prompt_embeddings = PromptEmbeddings(prompt_embeddings)
        self.arch = adapter_for(self.pipeline)
        self.scheduler = self.pipeline.scheduler
        self.base_transformer = self.pipeline.transformer
        self.lora_config = None
        self._reference: torch.nn.Module | None = None
        self._teacher: torch.nn.Module | None = None  # on-policy distillation's frozen teacher (`load_teacher`)

        if is_lora:
            self.base_transformer.requires_grad_(False)
            fresh = lora.build_lora_config(lora_rank or 8, lora_alpha, lora_init_weights, target_modules)
            if lora_adapter_path:
                adapter = resolve_model_path(
                    lora_adapter_path, key="actor_rollout_ref.model.lora_adapter_path", skip=TRANSFORMERS_SKIP
                )
                model = lora.load_lora_adapter(self.base_transformer, adapter, type(self.pipeline), fresh)
            else:
                model = lora.apply_lora(self.base_transformer, fresh)
            self.transformer: torch.nn.Module = model
            self.lora_config = model.peft_config[model.active_adapter]
            for param in self.trainable_parameters():  # fp32 adapters on a bf16 / fp16 base
                param.data = param.data.float()
            if not trainable:
                self.transformer.requires_grad_(False)
        else:
            self.base_transformer.requires_grad_(trainable)
            self.transformer = self.base_transformer

        if enable_gradient_checkpointing:
            self.base_transformer.enable_gradient_checkpointing()
        self.attn_backend = attn_backend
        self._set_attention_backend(attn_backend)

    @classmethod
    def from_model_config(cls, model_cfg, **overrides) -> FlowPolicy:
        """Build from a config section with the constructor's attribute names (``actor_rollout_ref.model``)."""
        kwargs = dict(
            architecture=model_cfg.architecture,
            lora_rank=model_cfg.lora_rank,
            lora_alpha=model_cfg.lora_alpha,
            lora_init_weights=getattr(model_cfg, "lora_init_weights", "gaussian"),
            target_modules=model_cfg.target_modules,
            lora_adapter_path=model_cfg.lora_adapter_path,
            enable_gradient_checkpointing=model_cfg.enable_gradient_checkpointing,
            attn_backend=model_cfg.attn_backend,
            revision=getattr(model_cfg, "revision", None),
        )
        kwargs.update(overrides)
        return cls(model_cfg.path, **kwargs)

    def sampling_view(self, prompt_embeddings: str | Path) -> FlowPolicy:
        """A second policy over this one's modules for sampling in the same process (verl's hybrid engine): the same
        transformer, VAE and scheduler objects, so every update is seen at once and nothing is copied. Prompts come
        from the `prompt_embeddings` file; no autocast, no torch.compile (turn it on with `enable_torch_compile`), no
        forward wrapper (DDP's forward prepares a backward a rollout never runs). Only for a policy whose weights
        are already in the rollout's dtype (`placement.rollout_shares_trained_weights`)."""
        from omni_core.models.prompt_embeddings import PromptEmbeddings

        view = copy.copy(self)  # shallow: the modules are shared
        view.compute_dtype, view._forward_module = None, None
        view.torch_compile, view._compile_options, view._compiled = False, {}, {}
        view.prompt_embeddings = PromptEmbeddings(prompt_embeddings)
        return view

    # ----------------------------------------------------------------------------- set-up helpers
    def _set_attention_backend(self, name: str) -> None:
        setter = getattr(self.base_transformer, "set_attention_backend", None)
        if setter is None:
            if name != "native":
                raise ValueError(f"attn_backend={name!r}: this diffusers version has no attention dispatcher")
            return
        try:
            setter(name)
        except Exception as err:  # unknown name, missing kernel package, unsupported device
            raise ValueError(f"attn_backend={name!r} could not be set on {type(self.base_transformer).__name__}: {err}") from err

    @property
    def is_lora(self) -> bool:
        return self.lora_config is not None

    def enable_torch_compile(self, dynamic: bool = False, backend: str = "inductor") -> None:
        """Run the transformer forwards of `velocity` through `torch.compile(module, dynamic=..., backend=...)` from now on.

        `dynamic=False` (what the config keys use): the first forward of each new shape / grad mode / train-eval mode
        compiles (tens of seconds on CPU); `dynamic=True` compiles shape-generic graphs (benchmarks/bench_compile.py
        compares the two). Inductor caches the kernels in `TORCHINDUCTOR_CACHE_DIR` (default
        `/tmp/torchinductor_$USER`), so a second process compiles faster. Dynamo's recompile limit is raised to
        `COMPILE_RECOMPILE_LIMIT` for this process. `backend`: torch.compile's (`aot_eager` traces the same graphs
        without generating kernels, for quick checks). Calling it again replaces the wrappers made so far.
        """
        import torch._dynamo

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILE_RECOMPILE_LIMIT)
        self.torch_compile, self._compile_options = True, {"dynamic": dynamic, "backend": backend}
        self._compiled.clear()
        self._maybe_compiled("trained", self.transformer)  # compiles nothing until its first call

    def compiled_modules(self) -> dict[str, nn.Module]:
        """The torch.compile wrappers made so far, by role: "trained" (the transformer, peft model under LoRA),
        "wrapped" (the module `forward_through` named, e.g. DDP) and "reference" (the frozen KL reference)."""
        return {role: compiled for role, (_, compiled) in self._compiled.items()}

    def _maybe_compiled(self, role: str, module: nn.Module) -> nn.Module:
        """`module`, or with torch.compile on its compiled wrapper (made once per module and role; a new module in
        the role, e.g. a new DDP wrapper after the ranks' group formed again, replaces the old wrapper)."""
        if not self.torch_compile:
            return module
        entry = self._compiled.get(role)
        if entry is None or entry[0] is not module:
            entry = (module, torch.compile(module, **self._compile_options))
            self._compiled[role] = entry
        return entry[1]

    @staticmethod
    def torch_compile_stats() -> dict[str, int]:
        """This process's torch.compile counters (Dynamo keeps them per process, over every compiled module):
        frames compiled, graphs made (one per compile or recompile) and graph breaks."""
        from torch._dynamo.utils import counters

        return {
            "frames_compiled": int(counters["frames"]["ok"]),
            "graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
        }

    def load_teacher(self, path: str | Path, revision: str | None = None) -> None:
        """Load on-policy distillation's teacher (verl-omni's `distillation.teacher_models.teacher_model`): the
        transformer of a full pipeline of the same architecture (a local folder or a Hub id at `revision`; LoRA must be
        merged first), frozen, in this policy's dtype and device. It replays the student's transitions on the student's
        noise grid, so a scheduler config other than the student's is refused, naming both."""
        folder = resolve_model_path(path, revision, key="distillation.teacher_models.teacher_model.model_path")
        teacher = load_pipeline(folder, type(self.pipeline).__name__, torch_dtype=self.dtype, text_encoders=False)
        mine, theirs = dict(self.scheduler.config), dict(teacher.scheduler.config)
        differ = config_differences(mine, theirs)
        if differ:
            raise ValueError(
                f"distillation.teacher_models.teacher_model.model_path={path}: its scheduler differs from the student's "
                f"({', '.join(f'{k}: {theirs.get(k)!r} vs {mine.get(k)!r}' for k in differ[:4])}); the teacher replays the "
                "student's transitions on the student's noise grid, so use a teacher of the same scheduler config"
            )
        self._teacher = teacher.transformer.to(self.device).requires_grad_(False).eval()
        setter = getattr(self._teacher, "set_attention_backend", None)
        if setter is not None:  # the student's attention backend (validated when the policy was built)
            setter(self.attn_backend)

    def ensure_reference(self) -> None:
        """Make the frozen reference model if one is needed (full fine-tuning only; LoRA disables adapters)."""
        if not self.is_lora and self._reference is None:
            self._reference = copy.deepcopy(self.base_transformer).requires_grad_(False).eval()

    # ----------------------------------------------------------------------------- prompts / latents
    @torch.no_grad()
    def encode_prompts(
        self,
        prompts: list[str],
        negative_prompts: list[str] | None = None,
        max_sequence_length: int = 128,
        do_cfg: bool = False,
    ) -> dict[str, torch.Tensor]:
        """The cond dict (``arch.cond_keys``): ``prompt_embeds [B, L, D]`` and ``pooled_prompt_embeds [B, P]`` (SD3,
        FLUX) or ``prompt_embeds_mask [B, L]`` (Qwen-Image) and, with ``do_cfg``, the same keys prefixed ``negative_``
        (empty-string negatives when none are given)."""
        if negative_prompts is not None and len(negative_prompts) != len(prompts):
            raise ValueError(f"{len(negative_prompts)} negative prompts for {len(prompts)} prompts")
        if self.prompt_embeddings is not None:
            if self.prompt_embeddings.max_sequence_length != max_sequence_length:
                raise ValueError(
                    f"the cached prompt embeddings were computed with max_sequence_length="
                    f"{self.prompt_embeddings.max_sequence_length}, not {max_sequence_length}"
                )
            negs = list(negative_prompts) if negative_prompts is not None else None
            return self.prompt_embeddings.cond(list(prompts), negs, do_cfg, self.device)
        if getattr(self.pipeline, "text_encoder", None) is None:
            raise ValueError("this policy was loaded without text encoders and has no prompt embeddings to look up")
        cond = self.arch.encode(list(prompts), negative_prompts, max_sequence_length, do_cfg, self.device)
        return {k: v.detach() for k, v in cond.items()}

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """Per-sample latent shape: SD3 ``(C, H/f, W/f)``; FLUX / Qwen-Image packed ``(H/2f * W/2f, 4C)``."""
        return self.arch.latent_shape(height, width)

    def prepare_latents(self, batch: int, height: int, width: int, generator: Generators = None) -> torch.Tensor:
        """Initial noise ``[B, *latent_shape]`` fp32; a list of generators gives row ``i`` from ``generator[i]``."""
        noise = randn_per_sample((batch, *self.arch.noise_shape(height, width)), generator, self.device)
        return self.arch.noise_to_latents(noise, height, width)

    def set_timesteps(self, num_steps: int, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Configure ``self.scheduler`` as the pipeline would; returns fp32 CPU ``timesteps [T]``, ``sigmas [T+1]``
        (``timesteps = sigmas[:-1] * num_train_timesteps``, ``sigmas[-1] = 0``)."""
        self.arch.set_timesteps(self.scheduler, num_steps, height, width)
        return self.scheduler.timesteps.float().cpu(), self.scheduler.sigmas.float().cpu()

    def train_schedule(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The scheduler's training schedule, fp32 CPU ``timesteps [N]`` and ``sigmas [N]`` (``N =
        num_train_timesteps``): a scheduler built afresh from this one's config, before any inference
        ``set_timesteps`` (its static shift applied, a dynamic one not), as a training script noises data."""
        fresh = type(self.scheduler).from_config(self.scheduler.config)
        n = int(fresh.config.num_train_timesteps)
        return fresh.timesteps[:n].float().cpu(), fresh.sigmas[:n].float().cpu()

    def decode(self, latents: torch.Tensor, height: int | None = None, width: int | None = None) -> torch.Tensor:
        """uint8 images ``[B, 3, H, W]``; FLUX / Qwen-Image need ``height``/``width`` for non-square images."""
        return self.arch.decode(latents.to(self.device), height, width)

    # ----------------------------------------------------------------------------- forward
    def velocity(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        cond: dict[str, torch.Tensor],
        guidance_scale: float = 1.0,
        use_reference: bool = False,
        height: int | None = None,
        width: int | None = None,
        detach_uncond: bool = False,
        true_cfg_scale: float = 1.0,
        use_teacher: bool = False,
    ) -> torch.Tensor:
        """Predicted velocity ``[B, *latent_shape]`` (fp32) at per-sample ``timesteps [B]`` (scheduler units).

        CFG runs as one batched forward ``[negative; positive]`` when ``cond`` holds negatives and the
        architecture's CFG scale is above 1 (``arch.cfg_scale``: SD3 ``guidance_scale``; FLUX and Qwen-Image
        ``true_cfg_scale``), combined by ``arch.combine_cfg`` (Qwen-Image rescales to the conditional norm);
        a guidance-distilled transformer (FLUX.1-dev) takes ``guidance_scale`` in its guidance embedding.
        ``use_reference=True`` evaluates the reference policy under ``no_grad``; ``use_teacher=True`` the distillation
        teacher (`load_teacher`), likewise.
        ``detach_uncond``: no gradient flows through the unconditional branch of CFG (flow_grpo's training
        forward); the value is the same.
        """
        batch = latents.shape[0]
        cfg_scale = self.arch.cfg_scale(guidance_scale, true_cfg_scale)
        do_cfg = cfg_scale > 1.0 and "negative_prompt_embeds" in cond
        x = latents.to(self.device, self.dtype)
        t = torch.as_tensor(timesteps, device=self.device).float().reshape(-1).expand(batch).to(self.dtype)
        fwd_cond = {k: cond[k].to(self.device, self.dtype) for k in self.arch.cond_keys}
        if do_cfg:
            fwd_cond = {k: torch.cat([cond["negative_" + k].to(self.device, self.dtype), v]) for k, v in fwd_cond.items()}
            x, t = torch.cat([x, x]), torch.cat([t, t])
        if self.torch_compile:  # Dynamo guards on strides: a view and a fresh tensor of one shape would compile twice
            x, t, fwd_cond = x.contiguous(), t.contiguous(), {k: v.contiguous() for k, v in fwd_cond.items()}

        role, model = ("wrapped", self._forward_module) if self._forward_module is not None else ("trained", self.transformer)
        adapter_ctx, grad_ctx = contextlib.nullcontext(), contextlib.nullcontext()
        if use_teacher:
            if self._teacher is None:
                raise ValueError("no distillation teacher is loaded (load_teacher)")
            role, grad_ctx, model = "teacher", torch.no_grad(), self._teacher
        elif use_reference:
            role, grad_ctx, model = "reference", torch.no_grad(), self.transformer
            if self.is_lora:
                adapter_ctx = self.transformer.disable_adapter()
            else:
                self.ensure_reference()
                model = self._reference
        model = self._maybe_compiled(role, model)
        with adapter_ctx, grad_ctx, self.autocast():
            out = self.arch.forward(model, x, t, fwd_cond, guidance_scale, height, width).float()
        if do_cfg:
            uncond, cond_out = out.chunk(2)
            if detach_uncond:
                uncond = uncond.detach()
            out = self.arch.combine_cfg(uncond, cond_out, cfg_scale)
        return out

    @contextlib.contextmanager
    def eager_forwards(self, eager: bool = True) -> Iterator[None]:
        """Within (when `eager`): the transformer forwards run eagerly even with torch.compile on, e.g. for a batch
        shape used too rarely to repay its compile (validation). The compiled wrappers are kept for later."""
        before = self.torch_compile
        self.torch_compile = before and not eager
        try:
            yield
        finally:
            self.torch_compile = before

    @contextlib.contextmanager
    def forward_through(self, module: torch.nn.Module | None) -> Iterator[None]:
        """Within: the trained transformer's forwards (not the reference's) run through `module`, a wrapper of
        `self.transformer` such as `DistributedDataParallel`, whose forward prepares the gradient averaging of
        the backward that follows. None changes nothing."""
        before, self._forward_module = self._forward_module, module
        try:
            yield
        finally:
            self._forward_module = before

    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision of the transformer forward (``compute_dtype``), or nothing when it equals ``dtype``."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def modules_on_device(self) -> dict[str, torch.nn.Module]:
        """Every computing module of the policy by name (transformer, reference, VAE, text encoders present)."""
        names = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
        found = {n: getattr(self.pipeline, n, None) for n in names}
        modules = {n: m for n, m in found.items() if isinstance(m, torch.nn.Module)}
        modules["trained"] = self.transformer
        if self._reference is not None:
            modules["reference"] = self._reference
        if self._teacher is not None:
            modules["teacher"] = self._teacher
        return modules

    # ----------------------------------------------------------------------------- trainable state
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.transformer.parameters() if p.requires_grad]

    def named_trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self.transformer.named_parameters() if p.requires_grad}

    def state_dict_for_checkpoint(self) -> dict[str, torch.Tensor]:
        """LoRA: adapter weights only (peft keys); full: the whole transformer state dict."""
        if self.is_lora:
            return {k: v.detach().clone() for k, v in lora.lora_state(self.transformer).items()}
        return {k: v.detach().clone() for k, v in self.base_transformer.state_dict().items()}

    def load_trainable_state(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Inverse of ``state_dict_for_checkpoint`` (strict: mismatched keys raise)."""
        if self.is_lora:
            lora.load_lora_state(self.transformer, state_dict)
        else:
            self.base_transformer.load_state_dict(state_dict, strict=True)

    def save_pretrained(self, out_dir: str | Path, state: dict[str, torch.Tensor] | None = None) -> Path:
        """LoRA: ``out_dir/pytorch_lora_weights.safetensors`` (``pipeline.load_lora_weights(out_dir)`` reads
        it); full: the transformer in diffusers format (``config.json`` + safetensors) in ``out_dir``.

        ``state`` (``state_dict_for_checkpoint``'s keys) replaces the module's own tensors, for a transformer
        whose parameters are FSDP2 shards: the file is what ``save_pretrained`` of the whole model writes.
        """
        out = Path(out_dir)
        if self.is_lora:
            lora.save_lora_adapter(self.transformer, out, type(self.pipeline), adapter_state=state)
        elif state is None:
            self.base_transformer.save_pretrained(out, safe_serialization=True)
        else:
            from diffusers.utils import SAFETENSORS_WEIGHTS_NAME
            from safetensors.torch import save_file

            out.mkdir(parents=True, exist_ok=True)
            self.base_transformer.save_config(out)
            save_file(
                {k: v.contiguous() for k, v in state.items()}, str(out / SAFETENSORS_WEIGHTS_NAME), metadata={"format": "pt"}
            )
        return out
