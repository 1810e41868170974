#!/usr/bin/env python
"""GPU smoke benchmark: Flow-GRPO rollout and training of the published SD3.5-medium and FLUX.1-dev
architectures (random weights) at 512x512 in bf16, on one NVIDIA GPU.

For each model (``--models``) and training mode (``lora``: rank 32 on flow_grpo's SD3 attention projections;
``full``: where fp32 weights + grads + AdamW moments fit in GPU memory, else ``skipped`` with the arithmetic):

1. build: the pipeline from the published configs (``omni_core.models.published_configs``), random init on the
   GPU, saved as bf16 safetensors under ``--work-dir``; every copy below loads it with ``FlowPolicy(path, ...)``;
2. rollout: ``generate`` of 2 prompts x n=4 = 8 samples, 10 steps, SDE window 2, on a copy with bf16 weights
   (images/s after one warm-up call);
3. on the training copy (fp32 master weights, forward / backward under ``--compute-dtypes`` autocast, bf16):
   ``flops``, the transformer's TFLOP/s for one forward and one forward+backward of the training micro-batch
   (``FlopCounterMode`` FLOPs over CUDA-event time) against a bf16 matmul peak measured in the same run;
   ``logprob_precision``, |log-prob(fp32) - log-prob(bf16 autocast)| over the rollout's stored transitions;
   ``train``, ``--updates`` PPO updates (old log-probs + ``ppo_update`` with the TrainingActor's step function):
   samples/s and the first on-policy ratio (``actor/ratio_mean`` before the weights move: ~1);
4. ``fsdp2_train`` (``actor.strategy=fsdp2`` on one rank): a process group of this process alone (NCCL; gloo on
   CPU), a fresh training copy sharded with ``omni_core.distributed.fsdp2.shard_transformer`` (parameters gathered in
   the compute dtype, gradients reduced in fp32), the same PPO updates on the same trajectory as the training
   actor runs them (root ``reshard()`` before the update, ``no_gradient_sync`` between micro-batches): samples/s,
   the first ratio, finite loss / grad norm, the first grad norm against ``train``'s, and ``full_trainable_state``
   gathered once (every tensor finite, its parameter elements = the unsharded trainable parameter count).

Every phase records its peak GPU memory and is guarded: an OOM becomes ``{"status": "oom"}`` and the run goes on.
The JSON (``--out``) is rewritten after every phase. Without CUDA the script exits 2, unless ``--cpu-check``:
the same code on CPU with shrunken configs (same classes, a few layers, 64 px), fp32 and bf16 compute.

    python benchmarks/gpu_smoke.py --out benchmarks/results/gpu_smoke.json [--models sd3.5-medium,flux.1-dev]
    python benchmarks/gpu_smoke.py --cpu-check --out /tmp/gpu_smoke_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.resources
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from omni_core.algorithms.flow_grpo import compute_flow_grpo_advantages  # noqa: E402
from omni_core.algorithms.update import (  # noqa: E402
    PPOUpdateConfig,
    StepOutput,
    build_optimizer,
    nonfinite_metrics,
    ppo_update,
)
from omni_core.distributed import fsdp2  # noqa: E402
from omni_core.models.policy import FlowPolicy  # noqa: E402
from omni_core.models.published_configs import build_published_pipeline, published_model  # noqa: E402
from omni_core.rollout.sampler import generate, score_transitions  # noqa: E402
from omni_core.rollout.trajectory import Trajectory  # noqa: E402

SCHEMA_VERSION = 1
NEEDS_GPU = "gpu_smoke.py needs an NVIDIA GPU (torch.cuda.is_available() is False); run it on a CUDA machine"
PROMPTS = ["a red circle on a white background", "a photo of a small black cat"]
# flow_grpo's LoRA targets for SD3 (scripts/train_sd3.py); the same names match FLUX's double-stream attention
# and the q/k/v projections of its single-stream blocks.
LORA_TARGETS = [
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "attn.to_k",
    "attn.to_out.0",
    "attn.to_q",
    "attn.to_v",
]
# FLUX.1-dev is guidance-distilled: the scale feeds its guidance embedding (3.5 is its usual value) and costs
# nothing; SD3.5 runs without CFG as OmniFlow's defaults do (CFG would double the transformer batch).
GUIDANCE = {"sd3.5-medium": 1.0, "flux.1-dev": 3.5}
# Samples per forward/backward on the GPU: FLUX's activations at 1152 tokens are ~7 GB per sample in bf16.
MICRO_BATCH = {"sd3.5-medium": 8, "flux.1-dev": 4}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The training ranks' process-group backends (omni_core.device.PROCESS_GROUP_BACKENDS, which imports the config
# schema and so pydantic: repeated here for the two devices this script runs on).
PROCESS_GROUP_BACKENDS = {"cuda": "nccl", "cpu": "gloo"}


def dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def project_defaults() -> dict[str, Any]:
    """The PPO, optimizer, LoRA and SDE knobs of ``omni_core/config/defaults.yaml`` (the one defaults file),
    read with PyYAML so that the GPU machine needs neither pydantic nor omegaconf."""
    text = (importlib.resources.files("omni_core") / "config" / "defaults.yaml").read_text()
    arr = yaml.safe_load(text)["actor_rollout_ref"]
    actor, rollout, model = arr["actor"], arr["rollout"], arr["model"]
    return {
        "optim": {k: actor["optim"][k] for k in ("lr", "betas", "weight_decay")},
        "grad_clip": actor["grad_clip"],
        "clip_ratio": actor["diffusion_loss"]["clip_ratio"],
        "adv_clip_max": actor["diffusion_loss"]["adv_clip_max"],
        "loss_mode": actor["diffusion_loss"]["loss_mode"],
        "data_loader_seed": actor["data_loader_seed"],
        "seed": rollout["seed"],
        "noise_level": rollout["algo"]["noise_level"],
        "sde_type": rollout["algo"]["sde_type"],
        "sde_window_range": rollout["algo"]["sde_window_range"],
        "lora_alpha": model["lora_alpha"],
        "lora_init_weights": model["lora_init_weights"],
    }


def full_ft_skip_reason(n_params: int, device_bytes: int) -> str | None:
    """Why full fine-tuning cannot fit, or None: fp32 weights (4 B) + fp32 grads (4 B) + AdamW's two fp32
    moments (8 B) = 16 bytes per parameter, before any activation."""
    need = 16 * n_params
    if need <= device_bytes:
        return None
    return (
        f"full fine-tuning with fp32 master weights: {n_params / 1e9:.2f} B parameters x 16 bytes (fp32 weights 4 + "
        f"grads 4 + AdamW moments 8) = {need / 1e9:.0f} GB > {device_bytes / 1e9:.0f} GB of device memory"
    )


# CPU SDPA runs ops FlopCounterMode has no formula for (bench_core.py adds the same two); on CUDA torch counts
# its flash / efficient / cuDNN attention kernels itself.
def _cpu_sdpa(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_sdpa_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


def flop_mapping() -> dict[Any, Any]:
    ops = {
        "_scaled_dot_product_flash_attention_for_cpu": _cpu_sdpa,
        "_scaled_dot_product_flash_attention_for_cpu_backward": _cpu_sdpa_backward,
    }
    return {getattr(torch.ops.aten, name): fn for name, fn in ops.items() if hasattr(torch.ops.aten, name)}


# ------------------------------------------------------------------------------------------ timing / memory
def wall(device: torch.device, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """``fn(*args, **kwargs)`` and its wall time, the device synchronised before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def device_time(device: torch.device, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """``fn(*args, **kwargs)`` and its time between two CUDA events (the GPU's own clock); the wall clock on CPU."""
    if device.type != "cuda":
        return wall(device, fn, *args, **kwargs)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn(*args, **kwargs)
    end.record()
    end.synchronize()
    return out, start.elapsed_time(end) / 1e3


def free_memory(device: torch.device) -> None:
    """Drop what the last phase left (cycles included) and return the cached blocks, so that the next phase's peak
    starts from what is really alive. Nothing on CPU, where memory is not measured (and gc costs ~0.3 s a call)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


@dataclass
class Settings:
    """The fixed workload; recorded in the JSON's ``settings``."""

    device: torch.device
    cpu_check: bool
    models: list[str]
    modes: list[str]
    size: int  # image height = width, pixels
    n: int  # samples per prompt
    steps: int
    window: int
    max_sequence_length: int
    lora_rank: int
    micro_batch: dict[str, int]
    rollout_dtype: torch.dtype
    compute_dtypes: list[torch.dtype]
    repeats: int
    updates: int
    time_budget_s: float | None
    work_dir: Path
    keep_models: bool
    defaults: dict[str, Any]

    def record(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items() if k not in ("device", "work_dir", "rollout_dtype", "compute_dtypes")}
        out.update(
            device=str(self.device),
            work_dir=str(self.work_dir),
            rollout_dtype=dtype_name(self.rollout_dtype),
            compute_dtypes=[dtype_name(d) for d in self.compute_dtypes],
            prompts=PROMPTS,
            lora_targets=LORA_TARGETS,
            guidance_scale=GUIDANCE,
            training_weights_dtype="float32",
        )
        return out


# ------------------------------------------------------------------------------------------ the pieces
@torch.no_grad()
def old_log_probs(policy: FlowPolicy, traj: Trajectory, micro: int, sde: dict[str, Any]) -> torch.Tensor:
    """``[B, W]`` log-probs, micro-batch by micro-batch as the update will see them (TrainingActor's layout)."""
    out = torch.empty(traj.log_probs.shape)
    for idx in torch.arange(traj.batch_size).split(micro):
        part = traj.index_select(idx)
        for j in range(traj.window_size):
            out[idx, j] = score_transitions(policy, part, j, **sde)[0].float().cpu()
    return out


def abs_diff(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    diff = (a.float().cpu() - b.float().cpu()).abs()
    return {"max_abs": diff.max().item(), "mean_abs": diff.mean().item(), "transitions": diff.numel()}


@contextlib.contextmanager
def single_rank_group(device: torch.device) -> Iterator[str]:
    """A ``torch.distributed`` group of this process alone (rank 0 of 1, TCP rendezvous on a free local port), as
    ``TrainingActor.join_process_group`` forms one; destroyed on exit, also on error, so that later phases and the
    next model start without one. Yields the backend name."""
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError(f"torch {torch.__version__} was built without torch.distributed: FSDP2 cannot run")
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed group is already initialised (a phase before did not destroy it)")
    backend = PROCESS_GROUP_BACKENDS[device.type]
    if backend == "nccl" and not dist.is_nccl_available():
        raise RuntimeError(f"torch {torch.__version__} has no NCCL backend: FSDP2 on CUDA cannot run")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        yield backend
    finally:
        dist.destroy_process_group()


class Smoke:
    """Runs the phases of every model; each phase's record lands in ``self.result`` as it finishes."""

    def __init__(self, s: Settings, out: Path, result: dict[str, Any]):
        self.s, self.out, self.result = s, out, result
        self.started = time.perf_counter()
        self.errors: list[str] = []
        self.peak_tflops: float | None = None

    # ------------------------------------------------------------------ plumbing
    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.started:7.1f}s] {msg}", flush=True)

    def flush(self) -> None:
        self.result["wall_s"] = time.perf_counter() - self.started
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.result, indent=2) + "\n")

    def guarded(self, record: dict, phase: str, label: str, fn: Callable[..., tuple[Any, dict]], *args: Any) -> Any:
        """Run one phase, ``fn(*args) -> (value, stats)``: ``record[phase]`` gets the stats with ``status`` ok, or
        oom / error / skipped; returns the value (None unless ok). Peak device memory is reset before, read after."""
        if self.s.time_budget_s is not None and time.perf_counter() - self.started > self.s.time_budget_s:
            record[phase] = {"status": "skipped", "reason": f"--time-budget-s {self.s.time_budget_s:g} s spent"}
            self.log(f"{label} {phase}: skipped (time budget)")
            return None
        cuda = self.s.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0, value = time.perf_counter(), None
        try:
            value, stats = fn(*args)
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
            record[phase] = {"status": "ok", **stats, "peak_memory_gib": peak, "phase_s": time.perf_counter() - t0}
            self.log(f"{label} {phase}: {time.perf_counter() - t0:.1f} s" + (f", peak {peak:.1f} GiB" if cuda else ""))
        except torch.cuda.OutOfMemoryError as err:
            record[phase] = {"status": "oom", "phase": f"{label} {phase}", "message": str(err).splitlines()[0][:400]}
            self.log(f"{label} {phase}: OOM")
        except Exception as err:  # one broken phase must not cost the rest of the device time
            record[phase] = {
                "status": "error",
                "phase": f"{label} {phase}",
                "message": f"{type(err).__name__}: {err}"[:1000],
                "traceback": traceback.format_exc()[-3000:],
            }
            self.errors.append(f"{label} {phase}: {type(err).__name__}: {err}")
            self.log(f"{label} {phase}: ERROR {type(err).__name__}: {err}")
        free_memory(self.s.device)
        self.flush()
        return value

    def _lora(self, mode: str) -> dict[str, Any]:
        if mode != "lora":
            return {}
        d = self.s.defaults
        return {
            "lora_rank": self.s.lora_rank,
            "lora_alpha": d["lora_alpha"],
            "lora_init_weights": d["lora_init_weights"],
            "target_modules": LORA_TARGETS,
        }

    def _sde(self, name: str) -> dict[str, Any]:
        d = self.s.defaults
        return {"guidance_scale": GUIDANCE[name], "noise_level": d["noise_level"], "sde_type": d["sde_type"]}

    def _micro(self, name: str) -> int:
        return min(self.s.micro_batch[name], len(PROMPTS) * self.s.n)

    # ------------------------------------------------------------------ phases
    def matmul_peak(self) -> tuple[None, dict]:
        """Best bf16 ``n x n @ n x n`` rate (2 n^3 flops), CUDA-event timed, after 3 warm-up products."""
        dev, gpu = self.s.device, self.s.device.type == "cuda"
        sizes, tries = ([4096, 8192], 10) if gpu else ([256, 512], 3)
        per_size = {}
        for n in sizes:
            a, b = (torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
            out = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
            for _ in range(3):
                torch.mm(a, b, out=out)
            rates = [2 * n**3 / device_time(dev, torch.mm, a, b, out=out)[1] / 1e12 for _ in range(tries)]
            per_size[str(n)] = {"best_tflops_per_s": max(rates), "median_tflops_per_s": statistics.median(rates)}
        self.peak_tflops = max(v["best_tflops_per_s"] for v in per_size.values())
        return None, {"dtype": "bfloat16", "tries": tries, "per_size": per_size, "peak_tflops_per_s": self.peak_tflops}

    def build(self, name: str, path: Path) -> tuple[dict, dict]:
        info = build_published_pipeline(path, name, shrink=self.s.cpu_check, device=self.s.device, seed=0)
        return info, {k: v for k, v in info.items() if k != "path"}

    def rollout(self, path: Path, name: str, mode: str) -> tuple[Trajectory, dict]:
        s = self.s
        kwargs = {
            "n": s.n,
            "seed": s.defaults["seed"],
            "prompt_indices": list(range(len(PROMPTS))),
            "height": s.size,
            "width": s.size,
            "num_inference_steps": s.steps,
            "sde_window_size": s.window,
            "sde_window_range": s.defaults["sde_window_range"],
            "max_sequence_length": s.max_sequence_length,
            "calculate_log_probs": True,
            **self._sde(name),
        }
        torch.manual_seed(s.defaults["data_loader_seed"])  # the LoRA init, as the training copy's
        policy, load_s = wall(
            s.device, FlowPolicy, path, dtype=s.rollout_dtype, device=s.device, trainable=False, **self._lora(mode)
        )
        _, warmup_s = wall(s.device, generate, policy, PROMPTS, global_step=0, **kwargs)
        times = []
        for _ in range(s.repeats):
            traj, dt = wall(s.device, generate, policy, PROMPTS, global_step=1, **kwargs)
            times.append(dt)
        median = statistics.median(times)
        stats = {
            "weights_dtype": dtype_name(s.rollout_dtype),
            "lora_rank": s.lora_rank if mode == "lora" else 0,
            "images": traj.batch_size,
            "load_s": load_s,
            "warmup_s": warmup_s,
            "times_s": times,
            "median_s": median,
            "images_per_s": traj.batch_size / median,
            "log_probs_finite": bool(torch.isfinite(traj.log_probs).all()),
            "generate_kwargs": {k: v for k, v in kwargs.items() if k != "prompt_indices"},
        }
        del policy
        return traj, stats

    def load_trained(self, path: Path, mode: str, compute: torch.dtype) -> tuple[FlowPolicy, dict]:
        s = self.s
        torch.manual_seed(s.defaults["data_loader_seed"])  # LoRA init is random (TrainingActor seeds the same way)
        # As the training actor loads it: no text encoders (the prompt embeddings come with the trajectories).
        kwargs = {
            "dtype": torch.float32,
            "compute_dtype": compute,
            "device": s.device,
            "text_encoders": False,
            **self._lora(mode),
        }
        policy, load_s = wall(s.device, FlowPolicy, path, **kwargs)
        trainable = sum(p.numel() for p in policy.trainable_parameters())
        return policy, {
            "load_s": load_s,
            "weights_dtype": "float32",
            "compute_dtype": dtype_name(compute),
            "trainable_parameters": trainable,
        }

    def flops(self, policy: FlowPolicy, traj: Trajectory, name: str) -> tuple[None, dict]:
        """One forward (no grad) and one forward+backward of the transformer on the training micro-batch."""
        s, micro = self.s, self._micro(name)
        part = traj.index_select(torch.arange(micro))
        x, t = part.latents[:, 0], part.timesteps[:, 0]
        cotangent = torch.randn(x.shape, generator=torch.Generator().manual_seed(0)).to(x.device)
        params = policy.trainable_parameters()

        def velocity():
            return policy.velocity(x, t, part.cond, GUIDANCE[name], height=s.size, width=s.size)

        def forward():
            with torch.no_grad():
                velocity()

        def forward_backward():
            (velocity() * cotangent).sum().backward()

        stats: dict[str, Any] = {
            "micro_batch": micro,
            "compute_dtype": dtype_name(policy.compute_dtype or policy.dtype),
            "tokens_per_sample": {
                "image": policy.arch.image_seq_len(s.size, s.size),
                "text": int(part.cond["prompt_embeds"].shape[1]),
            },
        }
        policy.transformer.train()
        for key, fn in (("forward", forward), ("forward_backward", forward_backward)):
            counter = FlopCounterMode(display=False, custom_mapping=flop_mapping())
            with counter:  # also the warm-up call
                fn()
            times = []
            for _ in range(max(s.repeats, 3)):
                for p in params:
                    p.grad = None
                times.append(device_time(s.device, fn)[1])
            flops, median = counter.get_total_flops(), statistics.median(times)
            by_op = counter.get_flop_counts()["Global"]
            tflops = flops / median / 1e12
            stats[key] = {
                "flops": flops,
                "attention_flops": sum(v for k, v in by_op.items() if "attention" in str(k)),
                "times_s": times,
                "median_s": median,
                "tflops_per_s": tflops,
                "fraction_of_bf16_matmul_peak": tflops / self.peak_tflops if self.peak_tflops else None,
            }
        for p in params:
            p.grad = None
        policy.transformer.eval()
        return None, stats

    def logprob_precision(self, policy: FlowPolicy, traj: Trajectory, name: str) -> tuple[None, dict]:
        """The rollout's stored transitions scored by the fp32 transformer, without and with bf16 autocast."""
        saved, micro = policy.compute_dtype, self._micro(name)
        try:
            policy.compute_dtype = None
            fp32 = old_log_probs(policy, traj, micro, self._sde(name))
            policy.compute_dtype = torch.bfloat16
            bf16 = old_log_probs(policy, traj, micro, self._sde(name))
        finally:
            policy.compute_dtype = saved
        return None, {
            "weights_dtype": "float32",
            "micro_batch": micro,
            **abs_diff(fp32, bf16),
            "fp32_log_prob_mean_abs": fp32.abs().mean().item(),
        }

    def train(self, policy: FlowPolicy, traj: Trajectory, name: str) -> tuple[None, dict]:
        """``--updates`` training steps as TrainingActor.train_on runs them: old log-probs, then ``ppo_update``."""
        optimizer = build_optimizer(self.s.defaults["optim"], policy.trainable_parameters())
        return None, self._ppo_updates(policy, traj, name, optimizer)

    def fsdp2_train(self, path: Path, mode: str, compute: torch.dtype, traj: Trajectory, name: str) -> tuple[None, dict]:
        """The ``train`` phase under ``actor.strategy=fsdp2`` on one rank: a group of this process alone, a fresh
        training copy sharded by ``workers.fsdp2.shard_transformer`` (each block, then the root; parameters
        all-gathered in the compute dtype, gradients reduced in fp32), AdamW over the shards, ``--updates`` PPO
        updates as ``TrainingActor._train_on`` runs them (old log-probs, the root's ``reshard()``, ``ppo_update``
        with ``no_gradient_sync`` between micro-batches), then ``full_trainable_state`` gathered once."""
        from torch.distributed.fsdp import fully_shard  # noqa: F401  (torch without FSDP2: the phase's error says so)

        with single_rank_group(self.s.device) as backend:
            policy, load = self.load_trained(path, mode, compute)
            # Counted on the whole (unsharded) module: what the gathered state must add up to.
            trainable = load["trainable_parameters"]
            sharded_blocks = fsdp2.shard_transformer(policy, world_size=1)
            optimizer = build_optimizer(self.s.defaults["optim"], policy.trainable_parameters())
            stats = self._ppo_updates(
                policy,
                traj,
                name,
                optimizer,
                before_update=policy.transformer.reshard,
                no_grad_sync=partial(fsdp2.no_gradient_sync, policy.transformer),
            )
            full, gather_s = wall(self.s.device, fsdp2.full_trainable_state, policy, 0)
            buffers = {key for key, _ in policy.transformer.named_buffers()}  # full FT: persistent buffers ride along
            gathered = {
                "tensors": len(full),
                "elements": sum(v.numel() for v in full.values()),
                "parameter_elements": sum(v.numel() for k, v in full.items() if k not in buffers),
                "all_finite": all(bool(torch.isfinite(v).all()) for v in full.values()),
                "gather_s": gather_s,
            }
            gathered["parameter_elements_equal_trainable"] = gathered["parameter_elements"] == trainable
        return None, {
            "backend": backend,
            "world_size": 1,
            "sharded_blocks": sharded_blocks,
            "mixed_precision": {"param_dtype": dtype_name(compute), "reduce_dtype": "float32"},
            "load_s": load["load_s"],
            "trainable_parameters": trainable,
            **stats,
            "gathered_state": gathered,
        }

    def compare_fsdp2(self, crec: dict[str, Any]) -> None:
        """``fsdp2_train.first_grad_norm_rel_diff_vs_train``: both phases start from the same freshly loaded weights
        and recompute the same old log-probs, so their first update's gradient is one computation, sharded or not
        (equal in fp32; within the compute dtype's rounding otherwise). A sharding that loses a gradient shows here."""
        sharded, whole = crec.get("fsdp2_train", {}), crec.get("train", {})
        if sharded.get("status") != "ok" or whole.get("status") != "ok":
            return
        a, b = sharded["updates"][0]["actor/grad_norm"], whole["updates"][0]["actor/grad_norm"]
        sharded["first_grad_norm_rel_diff_vs_train"] = abs(a - b) / abs(b) if b else abs(a - b)
        self.flush()

    def _ppo_updates(
        self,
        policy: FlowPolicy,
        traj: Trajectory,
        name: str,
        optimizer: torch.optim.Optimizer,
        before_update: Callable[[], Any] | None = None,
        no_grad_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
    ) -> dict[str, Any]:
        """``--updates`` times: old log-probs under no_grad in the update's micro-batch layout, ``before_update()``
        (FSDP2: the root's reshard), ``ppo_update``; the stats of the ``train`` and ``fsdp2_train`` phases."""
        s, d, micro, sde = self.s, self.s.defaults, self._micro(name), self._sde(name)
        batch_size = traj.batch_size
        # A stand-in reward (mean pixel value) gives group-normalised advantages; rewards never touch the GPU.
        advantages = compute_flow_grpo_advantages(traj.images.float().mean(dim=(1, 2, 3)).cpu(), traj.prompt_index)
        cfg = PPOUpdateConfig(
            mini_batch_size=batch_size,
            micro_batch_size=micro,
            ppo_epochs=1,
            clip_ratio=d["clip_ratio"],
            adv_clip_max=d["adv_clip_max"],
            kl_coef=0.0,
            grad_clip=d["grad_clip"],
            shuffle=False,
            seed=d["data_loader_seed"],
            loss_mode=d["loss_mode"],
        )
        fp16 = torch.float16 in (policy.compute_dtype, policy.dtype)
        scaler = torch.amp.GradScaler(s.device.type) if fp16 else None

        def step_fn(mb: dict[str, Any], j: int) -> StepOutput:
            log_prob, mean, std, _ = score_transitions(policy, traj.index_select(mb["sample"]), j, **sde)
            return StepOutput(log_prob=log_prob, prev_sample_mean=mean, std_dev_t=std)

        updates = []
        for _ in range(s.updates):
            old, old_s = wall(s.device, old_log_probs, policy, traj, micro, sde)
            if before_update is not None:
                before_update()
            batch = {"old_log_probs": old, "advantages": advantages, "sample": torch.arange(batch_size)}
            metrics, update_s = wall(
                s.device,
                ppo_update,
                policy.transformer,
                optimizer,
                None,
                batch,
                step_fn=step_fn,
                cfg=cfg,
                scaler=scaler,
                no_grad_sync=no_grad_sync,
            )
            updates.append(
                {
                    "old_log_prob_s": old_s,
                    "update_s": update_s,
                    **metrics,
                    "rollout_vs_recomputed_log_prob": abs_diff(traj.log_probs, old),
                }
            )
        policy.transformer.eval()
        last = updates[-1]
        nonfinite = sorted({key for u in updates for key in nonfinite_metrics(u, scaled=scaler is not None)})
        return {
            "micro_batch": micro,
            "mini_batch": batch_size,
            "transformer_fwd_bwd_per_update": batch_size * traj.window_size,
            "optimizer": {"name": "AdamW", **d["optim"], "grad_clip": d["grad_clip"]},
            "loss": {
                "loss_mode": d["loss_mode"],
                "clip_ratio": d["clip_ratio"],
                "adv_clip_max": d["adv_clip_max"],
                "kl_coef": 0.0,
            },
            "grad_scaler": scaler is not None,
            # Every update's loss and grad norm finite (with fp16's scaler: an overflow alone does not count).
            "finite": not nonfinite,
            "nonfinite_metrics": nonfinite,
            "first_on_policy_ratio_mean": updates[0]["actor/ratio_mean"],
            "first_on_policy_ratio_std": updates[0]["actor/ratio_std"],
            "rollout_vs_recomputed_log_prob": updates[0]["rollout_vs_recomputed_log_prob"],
            "update_s": last["update_s"],
            "update_samples_per_s": batch_size / last["update_s"],
            "step_samples_per_s": batch_size / (last["update_s"] + last["old_log_prob_s"]),
            "updates": updates,
        }

    # ------------------------------------------------------------------ one model
    def run_model(self, name: str) -> None:
        s = self.s
        rec: dict[str, Any] = {"source": published_model(name).source, "guidance_scale": GUIDANCE[name], "modes": {}}
        self.result["models"][name] = rec
        path = s.work_dir / name
        info = self.guarded(rec, "build", name, self.build, name, path)
        if info is None:
            return
        n_params = info["parameters"]["transformer"]
        if s.device.type == "cuda":
            device_bytes = torch.cuda.get_device_properties(s.device).total_memory
        else:
            device_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        for mode in s.modes:
            mrec: dict[str, Any] = {}
            rec["modes"][mode] = mrec
            reason = full_ft_skip_reason(n_params, device_bytes) if mode == "full" else None
            if reason:
                mrec["skipped"] = reason
                self.log(f"{name} {mode}: skipped ({reason})")
                continue
            label = f"{name} {mode}"
            traj = self.guarded(mrec, "rollout", label, self.rollout, path, name, mode)
            if traj is None:
                continue
            mrec["train"] = {}
            for k, compute in enumerate(s.compute_dtypes):
                crec: dict[str, Any] = {}
                mrec["train"][dtype_name(compute)] = crec
                clabel = f"{label} {dtype_name(compute)}"
                policy = self.guarded(crec, "load", clabel, self.load_trained, path, mode, compute)
                if policy is None:
                    continue
                self.guarded(crec, "flops", clabel, self.flops, policy, traj, name)
                if k == 0:  # the same fp32 weights for every compute dtype: measured once per mode
                    self.guarded(mrec, "logprob_precision", label, self.logprob_precision, policy, traj, name)
                self.guarded(crec, "train", clabel, self.train, policy, traj, name)
                del policy
                free_memory(s.device)
                # Its own fresh copy (sharding is in place and one-way), as the training actor starts from whole weights.
                self.guarded(crec, "fsdp2_train", clabel, self.fsdp2_train, path, mode, compute, traj, name)
                self.compare_fsdp2(crec)
            del traj
            free_memory(s.device)
        if not s.keep_models:
            shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------------------ entry point
def _versions() -> dict[str, Any]:
    import diffusers
    import peft
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
    }


def _machine(device: torch.device) -> dict[str, Any]:
    out = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(
            gpu_name=props.name,
            gpu_memory_gib=props.total_memory / 2**30,
            capability=f"{props.major}.{props.minor}",
            tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
            alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        )
    return out


def summary(result: dict[str, Any]) -> str:
    """A few lines per model: rollout images/s, |Δ log-prob|, and per training case samples/s, first ratio, TFLOP/s,
    and the same under FSDP2 with its gathered state."""

    def mem(rec: dict) -> str:
        return f", peak {rec['peak_memory_gib']:.1f} GiB" if rec.get("peak_memory_gib") is not None else ""

    peak = result.get("matmul_peak", {}).get("peak_tflops_per_s")
    lines = [f"bf16 matmul peak {peak:.3g} TFLOP/s" if peak else "bf16 matmul peak: n/a"]
    for name, rec in result["models"].items():
        build = rec.get("build", {})
        lines.append(f"{name}: build {build.get('status')}" + (f" in {build['total_s']:.1f} s" if "total_s" in build else ""))
        for mode, mrec in rec["modes"].items():
            if "skipped" in mrec:
                lines.append(f"  {mode}: skipped: {mrec['skipped']}")
                continue
            ro, lp = mrec.get("rollout", {}), mrec.get("logprob_precision", {})
            ok = ro.get("status") == "ok"
            lines.append(f"  {mode} rollout: " + (f"{ro['images_per_s']:.3g} images/s{mem(ro)}" if ok else str(ro.get("status"))))
            if lp.get("status") == "ok":
                lines.append(f"  {mode} |log-prob fp32 - bf16 autocast|: max {lp['max_abs']:.3g}, mean {lp['mean_abs']:.3g}")
            for compute, crec in mrec.get("train", {}).items():
                tr, fl = crec.get("train", {}), crec.get("flops", {})
                text = f"  {mode} train ({compute}): "
                if tr.get("status") == "ok":
                    ratio = tr["first_on_policy_ratio_mean"]
                    text += f"{tr['update_samples_per_s']:.3g} samples/s, first ratio {ratio:.6f}{mem(tr)}"
                else:
                    text += str(tr.get("status") or crec.get("load", {}).get("status"))
                if fl.get("status") == "ok":
                    f, fb = fl["forward"], fl["forward_backward"]
                    text += f"; transformer fwd {f['tflops_per_s']:.3g} / fwd+bwd {fb['tflops_per_s']:.3g} TFLOP/s"
                    if fb["fraction_of_bf16_matmul_peak"] is not None:
                        text += f" ({fb['fraction_of_bf16_matmul_peak']:.2f} of peak)"
                lines.append(text)
                fs = crec.get("fsdp2_train", {})
                text = f"  {mode} fsdp2 train ({compute}, 1 rank): "
                if fs.get("status") == "ok":
                    gathered = fs["gathered_state"]
                    text += (
                        f"{fs['update_samples_per_s']:.3g} samples/s, first ratio {fs['first_on_policy_ratio_mean']:.6f}, "
                        f"finite {fs['finite']}{mem(fs)}; gathered {gathered['parameter_elements']} of "
                        f"{fs['trainable_parameters']} trainable elements, finite {gathered['all_finite']}"
                    )
                else:
                    text += str(fs.get("status"))
                if fs:
                    lines.append(text)
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu_smoke.json"))
    p.add_argument("--models", default="sd3.5-medium,flux.1-dev", help="comma-separated: sd3.5-medium, flux.1-dev")
    p.add_argument("--modes", default="lora,full", help="comma-separated: lora, full")
    p.add_argument("--cpu-check", action="store_true", help="self-check on CPU with shrunken configs (64 px)")
    p.add_argument("--work-dir", default=None, help="where the pipelines are saved (default: a temporary folder)")
    p.add_argument("--keep-models", action="store_true", help="keep the saved pipelines")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (2 prompts)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--window", type=int, default=2, help="SDE window size")
    p.add_argument("--size", type=int, default=None, help="image size in pixels (default 512; 64 with --cpu-check)")
    p.add_argument("--max-sequence-length", type=int, default=None, help="T5 tokens (default 128; 32 with --cpu-check)")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=None, help="training micro-batch for every model (default per model)")
    p.add_argument(
        "--compute-dtypes", default=None, help="autocast dtypes of training (default bfloat16; float32,bfloat16 with --cpu-check)"
    )
    p.add_argument("--repeats", type=int, default=2, help="timed rollout / transformer calls after the warm-up")
    p.add_argument("--updates", type=int, default=2, help="PPO updates per training case (the last one is timed)")
    p.add_argument(
        "--time-budget-s", type=float, default=None, help="skip the phases that would start after this (default 480 on GPU)"
    )
    return p.parse_args(argv)


def settings(args: argparse.Namespace) -> Settings:
    cpu = args.cpu_check
    models = [m for m in args.models.split(",") if m]
    for m in models:
        try:
            published_model(m)
        except ValueError as err:
            raise SystemExit(f"--models={args.models!r}: {err}") from None
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - {"lora", "full"}:
        raise SystemExit(f"--modes={args.modes!r}: choose from lora, full")
    computes = (args.compute_dtypes or ("float32,bfloat16" if cpu else "bfloat16")).split(",")
    if set(computes) - set(DTYPES):
        raise SystemExit(f"--compute-dtypes={args.compute_dtypes!r}: choose from {', '.join(DTYPES)}")
    micro = {m: args.micro_batch or (4 if cpu else MICRO_BATCH[m]) for m in models}
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="omniflow-gpu-smoke-"))
    return Settings(
        device=torch.device("cpu" if cpu else "cuda"),
        cpu_check=cpu,
        models=models,
        modes=modes,
        size=args.size or (64 if cpu else 512),
        n=args.n,
        steps=args.steps,
        window=args.window,
        max_sequence_length=args.max_sequence_length or (32 if cpu else 128),
        lora_rank=args.lora_rank,
        micro_batch=micro,
        rollout_dtype=torch.bfloat16,
        compute_dtypes=[DTYPES[c] for c in computes],
        repeats=max(1, args.repeats),
        updates=max(1, args.updates),
        time_budget_s=args.time_budget_s or (None if cpu else 480.0),
        work_dir=work,
        keep_models=args.keep_models,
        defaults=project_defaults(),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.cpu_check and not torch.cuda.is_available():
        print(NEEDS_GPU, file=sys.stderr)
        return 2
    # Phases of very different shapes follow each other (a 24 GB bf16 copy, then a 48 GB fp32 one): growable
    # segments keep the freed memory reusable. Read at the first CUDA allocation, i.e. later than this line.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    s = settings(args)
    created_work_dir = args.work_dir is None
    if s.cpu_check:
        torch.set_num_threads(1)  # tiny shapes: one thread is as fast, and steady on a shared machine
    result: dict[str, Any] = {
        "benchmark": "omniflow.gpu_smoke",
        "schema_version": SCHEMA_VERSION,
        "mode": "cpu-check" if s.cpu_check else "gpu",
        "command": "python benchmarks/gpu_smoke.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "timestamp_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": _versions(),
        "machine": _machine(s.device),
        "settings": s.record(),
        "models": {},
    }
    smoke = Smoke(s, Path(args.out), result)
    smoke.log(f"{result['mode']} on {result['machine'].get('gpu_name', 'cpu')}; models {s.models}; work dir {s.work_dir}")
    try:
        smoke.guarded(result, "matmul_peak", "device", smoke.matmul_peak)
        for name in s.models:
            smoke.run_model(name)
            free_memory(s.device)
    finally:
        if created_work_dir and not s.keep_models:
            shutil.rmtree(s.work_dir, ignore_errors=True)
        result["errors"] = smoke.errors
        smoke.flush()
    print(f"wrote {args.out}\n{summary(result)}")
    if smoke.errors:
        print("errors:\n  " + "\n  ".join(smoke.errors), file=sys.stderr)
    return 1 if smoke.errors else 0


if __name__ == "__main__":
    sys.exit(main())
