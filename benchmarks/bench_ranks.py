#!/usr/bin/env python
"""Data-parallel training ranks and weight sync of OmniFlow on the tiny SD3 model (issue 12, "Benchmark").

Two measurements, each on a local Ray cluster that this script starts (``num_cpus=16``) and shuts down:

1. **Ranks.** For each rank count N (``--ranks``, default 1 2 4): N ``TrainingActor`` ranks in one
   torch.distributed group (``TrainingRanks.form_group``; gloo on CPU), all fed the same trajectory (one
   rollout of the tiny model, generated once in this process) and the same advantages; ``train_on`` is
   repeated (1 warm-up + ``--repeats`` steps). Training samples/s = global batch / the slowest rank's
   ``timing_s/update_actor``. The ranks are a subclass defined here (``TimedAllReduceRank``) that registers a
   DDP communication hook doing what DDP's default one does (divide by N, all-reduce) while it counts the bytes
   of every gradient bucket and times each bucket from issue to completion. Then each group all-reduces
   buffers of the same bucket sizes alone (after a barrier): the cost of the communication itself.
2. **Weight sync.** One version's sync as the trainer does it (``SyncFeed.publish_weights`` -> ``AgentLoopManager.
   update_weights``): rank 0's ``get_weights.remote()`` ObjectRef, then ``set_weights.remote(ref, v)`` on K
   receivers (K = 1, 2), for the tiny model and larger SD3 transformers built offline here. The receivers are
   plain actors (``WeightReceiver``) whose policy is built with the rollout workers' ``rollout_policy_kwargs``
   and whose ``set_weights`` is ``RolloutWorker.set_weights`` (``load_trainable_state``); real RolloutWorkers
   would also need a TransferQueue, which the sync does not touch.

With more than one CUDA device both run again on the GPUs (nccl, one GPU per actor); otherwise the JSON says
why not. Every timed quantity: warm-up, then the median of the repeats (all kept). Noise indicator: the CPU
share used by processes outside this script's process tree (its Ray cluster included) during each part.

    python benchmarks/bench_ranks.py [--out benchmarks/results/ranks.json] [--quick] [--ranks 1 2 4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from bench_core import PROMPTS, REWARD, _machine, _summary, _versions  # noqa: E402

from omni_core.algorithms.flow_grpo import compute_flow_grpo_advantages  # noqa: E402
from omni_core.config import OmniFlowConfig, config_from_dict, load_config, to_flat_dict  # noqa: E402
from omni_core.models.placement import rollout_policy_kwargs  # noqa: E402
from omni_core.models.policy import FlowPolicy  # noqa: E402
from omni_core.models.tiny import build_tiny_pipeline  # noqa: E402
from omni_core.rewards.manager import RewardManager  # noqa: E402
from omni_core.rollout.sampler import generate  # noqa: E402
from omni_core.rollout.sampling_params import SamplingParams  # noqa: E402
from omni_core.rollout.trajectory import Trajectory  # noqa: E402
from omni_core.workers.training_actor import PROCESS_GROUP_BACKENDS, TrainingActor  # noqa: E402
from omni_core.workers.training_ranks import TrainingRanks  # noqa: E402

SCHEMA_VERSION = 1
TIMEOUT_S = 900  # every Ray wait is bounded
# The project defaults (2 prompts x 8 samples = a global batch of 16, one mini-batch of 16: one optimizer step
# per training step, 64 px, 10 steps, SDE window 2) with a micro-batch of 4, so that 1, 2 and 4 ranks all train
# whole micro-batches (4 ranks: one micro-batch of 4 each) and every rank count does the same per-sample work.
RANK_OVERRIDES = ["trainer.device=cpu", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"]
# Weight-sync models: the tiny SD3 pipeline with its transformer replaced by a larger SD3Transformer2DModel
# (layers, heads x 64); text widths stay the tiny encoders' (joint / pooled 64). None: the tiny model as built.
SYNC_MODELS: dict[str, tuple[int, int] | None] = {"tiny": None, "sd3-4x512": (4, 8), "sd3-12x512": (12, 8)}


# ------------------------------------------------------------------------------------------ actors
class TimedAllReduceRank(TrainingActor):
    """A training rank whose DDP gradient all-reduce is counted (bytes per bucket) and timed (issue -> done)."""

    def join_process_group(self, *args: Any, **kwargs: Any) -> int:
        out = super().join_process_group(*args, **kwargs)
        self.bucket_bytes: list[int] = []
        self.bucket_seconds: list[float] = []
        # before DDP's first forward (the DDP wrapper is the trainer's)
        self.trainer.ddp.register_comm_hook(None, self._timed_allreduce)
        return out

    # No annotations on `bucket` and the return: DDP checks them against dist.GradBucket / Future[Tensor] by
    # identity, and this module's postponed annotations would be strings.
    def _timed_allreduce(self, _state: None, bucket):  # noqa: ANN001, ANN202
        import torch.distributed as dist

        buffer = bucket.buffer()
        buffer.div_(self.world_size)  # the average, as DDP's default hook
        self.bucket_bytes.append(buffer.numel() * buffer.element_size())
        started = time.perf_counter()

        def done(fut: torch.futures.Future) -> torch.Tensor:
            self.bucket_seconds.append(time.perf_counter() - started)
            return fut.value()[0]

        return dist.all_reduce(buffer, async_op=True).get_future().then(done)

    def bench_step(self, traj: Trajectory, advantages: torch.Tensor, step: int) -> dict[str, Any]:
        """One training step on this rank's samples of `traj` (the whole batch), as `train_step` after its read."""
        samples = self.local_samples(traj.batch_size, step)
        self.bucket_bytes, self.bucket_seconds = [], []
        metrics = self.train_on(traj.index_select(torch.tensor(samples)), advantages, step, samples=samples)
        return {
            "update_s": metrics["timing_s/update_actor"],
            "old_log_prob_s": metrics["timing_s/old_log_prob"],
            "samples": len(samples),
            "ratio_mean": metrics["actor/ratio_mean"],
            "bucket_bytes": list(self.bucket_bytes),
            "allreduce_s": sum(self.bucket_seconds),
        }

    def time_allreduce(self, bucket_bytes: list[int], repeats: int) -> list[float]:
        """Seconds to all-reduce fp32 buffers of these sizes, after a barrier (1 warm-up, then `repeats`)."""
        import torch.distributed as dist

        device = self.policy.device
        buffers = [torch.ones(n // 4, device=device) for n in bucket_bytes]
        times = []
        for _ in range(1 + repeats):
            dist.barrier()
            t0 = time.perf_counter()
            for buf in buffers:
                dist.all_reduce(buf)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        return times[1:]


class WeightReceiver:
    """A rollout worker's copy of the policy and its `set_weights`, without the TransferQueue and rewards."""

    def __init__(self, config: dict[str, Any], num_threads: int):
        torch.set_num_threads(num_threads)
        cfg = config_from_dict(config)
        self.policy = FlowPolicy.from_model_config(cfg.actor_rollout_ref.model, **rollout_policy_kwargs(cfg, None))

    def sizes(self) -> dict[str, int]:
        """The transformer's parameters, and the elements and bytes of its state dict (what a sync sends)."""
        state = self.policy.base_transformer.state_dict()
        return {
            "transformer_params": sum(p.numel() for p in self.policy.base_transformer.parameters()),
            "state_elements": sum(t.numel() for t in state.values()),
            "state_bytes": sum(t.numel() * t.element_size() for t in state.values()),
        }

    def set_weights(self, weights: dict[str, torch.Tensor], version: int) -> int:
        """`RolloutWorker.set_weights` (load the state); returns the bytes received."""
        self.policy.load_trainable_state(weights)
        return sum(t.numel() * t.element_size() for t in weights.values())


# ------------------------------------------------------------------------------------------ noise
class OtherCpuShare:
    """Share of all CPUs' time used by processes outside this process's tree (its Ray cluster is in the tree)."""

    def __init__(self) -> None:
        self.value: float | None = None

    @staticmethod
    def _tree_cpu_s() -> dict[int, float]:
        me = psutil.Process()
        out = {}
        for proc in [me, *me.children(recursive=True)]:
            try:
                t = proc.cpu_times()
                out[proc.pid] = t.user + t.system
            except psutil.Error:
                pass
        return out

    def __enter__(self) -> OtherCpuShare:
        self._cpu, self._tree = psutil.cpu_times(), self._tree_cpu_s()
        return self

    def __exit__(self, *exc: object) -> None:
        cpu, tree = psutil.cpu_times(), self._tree_cpu_s()
        total = sum(cpu) - sum(self._cpu)
        busy = total - (cpu.idle - self._cpu.idle) - (getattr(cpu, "iowait", 0.0) - getattr(self._cpu, "iowait", 0.0))
        own = sum(s - self._tree.get(pid, 0.0) for pid, s in tree.items())
        if total > 0:
            self.value = min(1.0, max(0.0, (busy - own) / total))


# ------------------------------------------------------------------------------------------ parts
def rollout_once(config: OmniFlowConfig) -> tuple[Trajectory, torch.Tensor]:
    """The trajectory every rank count trains on, and its Flow-GRPO advantages (jpeg_compressibility)."""
    policy = FlowPolicy.from_model_config(config.actor_rollout_ref.model, **rollout_policy_kwargs(config, None))
    params = SamplingParams.for_training(config.actor_rollout_ref.rollout)
    traj = generate(policy, PROMPTS, prompt_indices=list(range(len(PROMPTS))), **params.generate_kwargs(1))
    scores = RewardManager({"reward_functions": [REWARD]}).score(traj.images, REWARD).scores
    return traj, compute_flow_grpo_advantages(scores, traj.prompt_index)


def rank_config(model: Path, world: int, device: str, overrides: list[str]) -> OmniFlowConfig:
    ddp = ["actor_rollout_ref.actor.strategy=ddp", f"trainer.n_gpus_per_node={world}"] if world > 1 else []
    return load_config(
        overrides=[*RANK_OVERRIDES, *overrides, f"actor_rollout_ref.model.path={model}", f"trainer.device={device}", *ddp]
    )


def bench_ranks(
    model: Path,
    world: int,
    threads: int,
    traj_ref: Any,
    advantages: torch.Tensor,
    repeats: int,
    device: str,
    overrides: list[str],
) -> dict[str, Any]:
    """`world` ranks with `threads` torch threads each train `1 + repeats` steps on the same trajectory (made with
    `rank_config(model, 1, "cpu", overrides)`)."""
    import ray

    config = rank_config(model, world, device, overrides)
    remote = ray.remote(num_cpus=0, num_gpus=1 if device == "cuda" else 0)(TimedAllReduceRank)
    ranks = TrainingRanks(
        [remote.remote(config.model_dump(mode="json"), 1 + repeats, threads, rank=r, world_size=world) for r in range(world)]
    )
    try:
        t0 = time.perf_counter()
        ray.get([h.pid.remote() for h in ranks.handles], timeout=TIMEOUT_S)
        t1 = time.perf_counter()
        ranks.form_group(TIMEOUT_S)
        setup = {"actors_start_s": t1 - t0, "form_group_s": time.perf_counter() - t1}
        with OtherCpuShare() as load:
            steps = [
                ray.get([h.bench_step.remote(traj_ref, advantages, step) for h in ranks.handles], timeout=TIMEOUT_S)
                for step in range(1, 2 + repeats)
            ]
            buckets = steps[-1][0]["bucket_bytes"]
            isolated = []
            if world > 1:
                per_rank = ray.get([h.time_allreduce.remote(buckets, repeats) for h in ranks.handles], timeout=TIMEOUT_S)
                isolated = [max(times) for times in zip(*per_rank, strict=True)]
    finally:
        ranks.kill()
    slowest = [max(r["update_s"] for r in step) for step in steps]
    old_lp = [max(r["old_log_prob_s"] for r in step) for step in steps]
    allreduce = [max(r["allreduce_s"] for r in step) for step in steps]
    update = _summary(slowest[1:], slowest[:1])
    batch = int(advantages.shape[0])
    payload = sum(buckets)
    return {
        "world_size": world,
        "backend": PROCESS_GROUP_BACKENDS[device] if world > 1 else None,
        "threads_per_rank": threads,
        "samples_per_rank": steps[-1][0]["samples"],
        "update_s": update,
        "samples_per_s": batch / update["median_s"],
        "old_log_prob_s": _summary(old_lp[1:], old_lp[:1]),
        "step_samples_per_s": batch / statistics.median(a + b for a, b in zip(slowest[1:], old_lp[1:], strict=True)),
        "per_rank_update_median_s": [statistics.median(step[r]["update_s"] for step in steps[1:]) for r in range(world)],
        "first_ratio_mean_per_rank": [r["ratio_mean"] for r in steps[0]],
        "allreduce": {
            "buckets_per_step": len(buckets),
            "bucket_bytes": buckets,
            "bytes_per_step": payload,
            "bytes_per_step_per_warmup_and_repeat": [sum(step[0]["bucket_bytes"]) for step in steps],
            "ring_bytes_sent_per_rank_per_step": 2 * (world - 1) * payload // world,
            "in_step_s": _summary(allreduce[1:], allreduce[:1]),
            "in_step_share_of_update": statistics.median(allreduce[1:]) / update["median_s"],
            "isolated_s": _summary(isolated, []) if isolated else None,
            "isolated_mb_per_s": payload / 1e6 / statistics.median(isolated) if isolated else None,
            # nccl completes a work's future once its stream is synchronised with the caller's, not when the
            # collective ends on the GPU: on cuda, in_step_s is host-side and isolated_s (synchronised) is the cost.
            "in_step_timing": "host-side" if device == "cuda" else "issue to completion",
        },
        "other_processes_cpu_share": load.value,
        **setup,
    }


def build_sync_model(tiny: Path, name: str, out: Path) -> Path:
    """`tiny` itself, or a copy of it whose transformer is the larger SD3 config `SYNC_MODELS[name]` (random)."""
    from diffusers import SD3Transformer2DModel

    shape = SYNC_MODELS[name]
    if shape is None:
        return tiny
    layers, heads = shape
    shutil.copytree(tiny, out)
    shutil.rmtree(out / "transformer")
    base = SD3Transformer2DModel.load_config(tiny / "transformer")
    torch.manual_seed(0)
    wide = {"num_layers": layers, "num_attention_heads": heads, "attention_head_dim": 64, "caption_projection_dim": heads * 64}
    SD3Transformer2DModel.from_config({**base, **wide}).save_pretrained(out / "transformer", safe_serialization=True)
    return out


def bench_weight_sync(model: Path, repeats: int, device: str) -> dict[str, Any]:
    import ray

    config = load_config(overrides=[f"actor_rollout_ref.model.path={model}", f"trainer.device={device}"])
    payload = config.model_dump(mode="json")
    gpus = 1 / 3 if device == "cuda" and torch.cuda.device_count() < 3 else (1 if device == "cuda" else 0)
    sender = ray.remote(num_cpus=0, num_gpus=gpus)(TrainingActor).remote(payload, 1, 1)
    receivers = [ray.remote(num_cpus=0, num_gpus=gpus)(WeightReceiver).remote(payload, 1) for _ in range(2)]
    out: dict[str, Any] = {"path": model.name, "device": device, "threads_per_actor": 1}
    try:
        t0 = time.perf_counter()
        ray.get([sender.pid.remote(), *[r.sizes.remote() for r in receivers]], timeout=TIMEOUT_S)
        out["actors_start_s"] = time.perf_counter() - t0
        out.update(ray.get(receivers[0].sizes.remote(), timeout=TIMEOUT_S))
        version = 0
        with OtherCpuShare() as load:
            for k in (1, 2):
                totals, produce, nbytes = [], [], 0
                for _ in range(1 + repeats):
                    version += 1
                    t0 = time.perf_counter()
                    ref = sender.get_weights.remote()
                    ray.wait([ref], timeout=TIMEOUT_S, fetch_local=False)
                    t1 = time.perf_counter()
                    nbytes = ray.get([r.set_weights.remote(ref, version) for r in receivers[:k]], timeout=TIMEOUT_S)[0]
                    totals.append(time.perf_counter() - t0)
                    produce.append(t1 - t0)
                    del ref
                total = _summary(totals[1:], totals[:1])
                out[f"receivers_{k}"] = {
                    "total_s": total,
                    "get_weights_s": _summary(produce[1:], produce[:1]),
                    "mb_per_s": nbytes / 1e6 / total["median_s"],
                    "delivered_mb_per_s": k * nbytes / 1e6 / total["median_s"],
                }
        out["bytes"] = nbytes
        out["other_processes_cpu_share"] = load.value
    finally:
        for actor in (sender, *receivers):
            ray.kill(actor, no_restart=True)
    return out


# ------------------------------------------------------------------------------------------ main
def rank_part(tiny: Path, traj_ref: Any, advantages: torch.Tensor, args: argparse.Namespace, device: str) -> dict[str, Any]:
    """Every rank count of `--ranks`, with the trainer's threads per rank (`cpu_threads`: cores // ranks), plus
    one rank on one thread on CPU: the unit of the ideal time of N single-thread ranks on C cores, T / min(N, C)."""
    cores = len(os.sched_getaffinity(0)) if device == "cpu" else max(args.ranks)
    runs = {str(n): (n, max(1, cores // n) if device == "cpu" else 1) for n in args.ranks}
    if device == "cuda":
        runs = {k: v for k, v in runs.items() if v[0] <= torch.cuda.device_count()}
    elif cores > 1 and 1 in args.ranks and max(args.ranks) > 1:
        runs["1_1thread"] = (1, 1)
    out: dict[str, Any] = {}
    for key, (world, threads) in runs.items():
        out[key] = entry = bench_ranks(tiny, world, threads, traj_ref, advantages, args.repeats, device, [])
        print(
            f"[{device}] {world} rank(s) x {threads} thread(s): {entry['samples_per_s']:.2f} samples/s "
            f"(update {entry['update_s']['median_s']:.3f} s), all-reduce {entry['allreduce']['bytes_per_step'] / 1e6:.2f} MB/step "
            f"in {entry['allreduce']['in_step_s']['median_s']:.4f} s; other processes' CPU share {entry['other_processes_cpu_share']}",
            flush=True,
        )
    one, unit = out.get("1"), out.get("1_1thread", out.get("1"))
    for entry in out.values():
        if one is None or unit is None:
            break
        tn, n = entry["update_s"]["median_s"], entry["world_size"]
        ideal = unit["update_s"]["median_s"] / min(n, cores)
        entry["vs_one_rank"] = {
            "speedup": one["update_s"]["median_s"] / tn,
            "ideal_update_s": ideal,
            "overhead_s_per_step": tn - ideal,
            "overhead_share": tn / ideal - 1,
        }
    return out


def sync_part(tiny: Path, tmp: Path, args: argparse.Namespace, device: str) -> dict[str, Any]:
    """Weight sync of every model of `--sync-models` (built, measured, deleted one after the other)."""
    out: dict[str, Any] = {}
    for name in args.sync_models:
        t0 = time.perf_counter()
        model = build_sync_model(tiny, name, tmp / name)
        build_s = time.perf_counter() - t0
        out[name] = entry = bench_weight_sync(model, args.repeats, device)
        entry.update(model=name, build_s=build_s, layers_and_heads_of_64=SYNC_MODELS[name])
        one, two = entry["receivers_1"], entry["receivers_2"]
        print(
            f"[{device}] sync {name}: {entry['bytes'] / 1e6:.1f} MB, 1 receiver {one['total_s']['median_s']:.3f} s "
            f"({one['mb_per_s']:.0f} MB/s), 2 receivers {two['total_s']['median_s']:.3f} s; "
            f"other processes' CPU share {entry['other_processes_cpu_share']}",
            flush=True,
        )
        if model != tiny:
            shutil.rmtree(model, ignore_errors=True)
    fit = None
    if len(out) > 1:  # seconds = fixed + per GB x size: least squares over the models' medians
        sizes = [e["bytes"] / 1e9 for e in out.values()]
        fit = {f"receivers_{k}": _line([e[f"receivers_{k}"]["total_s"]["median_s"] for e in out.values()], sizes) for k in (1, 2)}
    return {"models": out, "fit_seconds_vs_gb": fit}


def _line(ys: list[float], xs: list[float]) -> dict[str, float]:
    """Least-squares `y = intercept + slope x`."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return {"fixed_s": my - slope * mx, "s_per_gb": slope, "gb_per_s_marginal": 1 / slope if slope > 0 else None}


def run_all(tmp: Path, args: argparse.Namespace, device: str) -> dict[str, Any]:
    """Both parts on `device` (cpu: gloo; cuda: nccl, rank counts up to the number of GPUs)."""
    import ray

    tiny = build_tiny_pipeline(tmp / "tiny-sd3", "sd3", seed=0)
    config = rank_config(tiny, 1, "cpu", [])
    t0 = time.perf_counter()
    traj, advantages = rollout_once(config)
    rollout_s = time.perf_counter() - t0
    traj_ref = ray.put(traj)
    return {
        "config": {
            "prompts": PROMPTS,
            "reward": REWARD,
            "rank_overrides": RANK_OVERRIDES,
            "overrides_of_n_ranks": ["actor_rollout_ref.actor.strategy=ddp", "trainer.n_gpus_per_node=N"],
            **to_flat_dict(config),
        },
        "rollout_s": rollout_s,
        "ranks": rank_part(tiny, traj_ref, advantages, args, device),
        "weight_sync": sync_part(tiny, tmp, args, device),
    }


def gpu_part(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The same on CUDA devices (nccl) when there are more than one; otherwise why it was not run."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.no_gpu:
        return {"status": "not run", "reason": "--no-gpu"}
    if count <= 1:
        why = f"torch.cuda.device_count() = {count} (torch {torch.__version__}); needs more than one GPU for nccl ranks"
        return {"status": "not run", "reason": why}
    names = [torch.cuda.get_device_name(i) for i in range(count)]
    result = run_all(tmp / "gpu", args, "cuda")
    result.pop("config")
    return {"status": "ok", "devices": names, **result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "ranks.json"), help="JSON result path")
    parser.add_argument("--quick", action="store_true", help="smoke run: ranks 1 2, 2 repeats, tiny model sync only")
    parser.add_argument("--ranks", type=int, nargs="+", default=None, help="rank counts (default 1 2 4; 1 2 with --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats after 1 warm-up (default 5; 2 with --quick)")
    parser.add_argument("--sync-models", nargs="+", choices=sorted(SYNC_MODELS), default=None, help="weight-sync models")
    parser.add_argument("--no-gpu", action="store_true", help="skip the GPU part even where there are GPUs")
    args = parser.parse_args(argv)
    args.ranks = args.ranks or ([1, 2] if args.quick else [1, 2, 4])
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.sync_models = args.sync_models or (["tiny"] if args.quick else list(SYNC_MODELS))
    batch = 16  # 2 prompts x 8 samples (the defaults)
    bad = [n for n in args.ranks if n < 1 or batch % n or (batch // n) % 4]
    if bad or args.repeats < 1:
        parser.error(f"--ranks must divide the global batch of {batch} into whole micro-batches of 4 (1, 2 or 4); got {bad}")

    for key, value in {"RAY_USAGE_STATS_ENABLED": "0", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}.items():
        os.environ.setdefault(key, value)
    import ray

    started = time.perf_counter()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(0)
    machine = _machine()
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # A cluster of its own (address="local"), never one found through RAY_ADDRESS; shut down at the end.
    ray.init(address="local", num_cpus=16, num_gpus=count, include_dashboard=False, log_to_driver=False, namespace="bench-ranks")
    try:
        with tempfile.TemporaryDirectory(prefix="omniflow-bench-ranks-") as tmp:
            cpu = run_all(Path(tmp), args, "cpu")
            gpu = gpu_part(args, Path(tmp))
    finally:
        ray.shutdown()
    machine["loadavg_end"] = list(os.getloadavg())
    result = {
        "benchmark": "omniflow.ranks",
        "schema_version": SCHEMA_VERSION,
        "mode": "quick" if args.quick else "default",
        "command": "python benchmarks/bench_ranks.py"
        + (" --quick" if args.quick else "")
        + f" --ranks {' '.join(map(str, args.ranks))} --out {args.out}",
        "repeats": args.repeats,
        "timestamp_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": {**_versions(), "ray": ray.__version__},
        "machine": machine,
        "config": cpu.pop("config"),
        "cpu": cpu,
        "gpu": gpu,
        "wall_s": time.perf_counter() - started,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"wrote {out} ({result['wall_s']:.0f} s; load average {machine['loadavg_start'][0]:.2f} -> {machine['loadavg_end'][0]:.2f})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
