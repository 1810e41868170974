#!/usr/bin/env python
"""torch.compile of the transformer (`actor_rollout_ref.{actor,rollout}.use_torch_compile`) on the main job (issue 14).

What one step of the main job (`make run`: the defaults, 24 steps of 2 prompts x 8 samples, 64 px, 10 denoising
steps, window 2, one rollout worker on 1 torch thread, one training rank on 2) spends per phase with the transformer
eager and compiled, what compiling costs, and what that means for the whole job. omni_core's real classes, no Ray:

- rollout: `generate_groups` of the 2 prompts (16 samples, as a rollout worker runs a request) on a rollout
  `FlowPolicy` (`rollout_policy_kwargs`), 1 thread; validation: the same for the 2 validation prompts at
  `val_kwargs` (n=1: another batch shape; the rollout worker runs it eager, measured here to show why);
- old log-probs and the PPO update: `TrainingActor.train_on` (its `timing_s/old_log_prob` and
  `timing_s/update_actor`), 2 threads.

Each measurement runs in a fresh child process with `TORCHINDUCTOR_CACHE_DIR` set to a folder of this run: first
an empty folder (**cold**: Dynamo traces, Inductor generates and builds every kernel), then the same folder again
(**warm**: a run's second start, Inductor's FX-graph and AOTAutograd caches hit). In a child: one eager call of
each phase (warm-up), the compile stack's own first-compile cost (a one-op function), then the switch on and the
first compiled call of each phase in the order a run makes them (its time minus the eager median = that phase's
compile time, with the graphs Dynamo made), then `--repeats` rounds that alternate eager and compiled calls of
every phase (`FlowPolicy.torch_compile` toggled; the order flips each round, so a load drift hits both), medians
and minima kept. Then the numerics on one set of weights: velocity compiled vs eager, the rollout's log-probs
against the recomputed old ones for every eager / compiled pairing (max |difference|), the images, and the first
on-policy ratio of an update with the training side compiled.

`--variants static dynamic`: `dynamic=False` (what the config keys use: one graph per batch shape and grad mode)
and `dynamic=True` (shape-generic graphs). `projection` per variant and cache state: compile seconds (plus the
compile stack once per process: the rollout worker and the training actor are two) against 24 x the per-step
saving, for each switch alone and both; a positive `net_s` means compiling makes the main job slower.
`--data-parallel [ddp fsdp2]` adds a check of 2 training ranks with the actor switch (`TrainingRanks` on a local
Ray cluster this script starts; gloo, 32 px) against one eager rank. The machine's load goes with every child
(`other_cpu_share`: CPU used outside this benchmark; the 2-thread training phases slow down many times over when
another process takes a core, so compare minima too).

    python benchmarks/bench_compile.py [--out benchmarks/results/compile.json] [--repeats 7] [--variants static dynamic]
                                       [--data-parallel [ddp fsdp2]]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from bench_core import OtherCpuLoad, _machine, _versions  # noqa: E402

from omni_core.config import OmniFlowConfig, load_config  # noqa: E402
from omni_core.models.placement import rollout_policy_kwargs  # noqa: E402
from omni_core.models.policy import FlowPolicy  # noqa: E402
from omni_core.models.tiny import build_tiny_pipeline  # noqa: E402
from omni_core.rollout.sampler import generate_groups  # noqa: E402
from omni_core.rollout.sampling_params import SamplingParams  # noqa: E402
from omni_core.rollout.trajectory import Trajectory  # noqa: E402
from omni_core.workers.training_actor import TrainingActor  # noqa: E402

SCHEMA_VERSION = 1
PROMPTS = ["a red circle on a white background", "a photo of a small black cat"]
VAL_PROMPTS = ["a green dot", "a blue square"]
MAIN_JOB_STEPS = 24  # trainer.total_epochs=6 x 4 steps (8 prompts / data.train_batch_size=2)
ROLLOUT_THREADS = 1  # omni_core.agent_loop.ROLLOUT_WORKER_THREADS
TRAINING_THREADS = 2  # trainer.base.cpu_threads(1) on 2 cores
PHASES = ("rollout", "validation", "old_log_prob", "update")
ACTOR_PHASES, TRAINING_PHASES = ("old_log_prob", "update"), ("rollout", "old_log_prob", "update")


# ----------------------------------------------------------------------------------------------- child
class Phases:
    """The main job's phases on one rollout policy and one training actor, each callable eager or compiled."""

    def __init__(self, config: OmniFlowConfig, dynamic: bool):
        self.dynamic = dynamic
        self.actor = TrainingActor(config.model_dump(mode="json"), MAIN_JOB_STEPS, TRAINING_THREADS)
        self.rollout = FlowPolicy.from_model_config(config.actor_rollout_ref.model, **rollout_policy_kwargs(config, None))
        self.rollout.transformer.eval()
        self.train_params = SamplingParams.for_training(config.actor_rollout_ref.rollout)
        self.val_params = SamplingParams.for_validation(config.actor_rollout_ref.rollout)
        self.advantages = torch.linspace(-1.0, 1.0, len(PROMPTS) * self.train_params.n)
        self.step = 0
        self.traj: Trajectory | None = None
        self.enabled = False

    def compiled(self, on: bool) -> None:
        """Switch both policies' transformer forwards to compiled (`on`) or eager; the compiled wrappers are kept."""
        for policy in (self.rollout, self.actor.policy):
            if on and not self.enabled:
                policy.enable_torch_compile(dynamic=self.dynamic)
            policy.torch_compile = on
        self.enabled = self.enabled or on

    def generate(self, params: SamplingParams, prompts: list[str]) -> tuple[Trajectory, float]:
        torch.set_num_threads(ROLLOUT_THREADS)
        t0 = time.perf_counter()
        traj = generate_groups(self.rollout, prompts, prompt_indices=list(range(len(prompts))), **params.generate_kwargs(1))
        return traj, time.perf_counter() - t0

    def round(self) -> dict[str, Any]:
        """One call of each phase: {phase: seconds}, plus the update's metrics."""
        self.traj, rollout_s = self.generate(self.train_params, PROMPTS)
        _, validation_s = self.generate(self.val_params, VAL_PROMPTS)
        torch.set_num_threads(TRAINING_THREADS)
        self.step += 1
        metrics = self.actor.train_on(self.traj, self.advantages, self.step)
        self.rollout.load_trainable_state(self.actor.get_weights())  # the sync mode's weight push
        return {
            "rollout": rollout_s,
            "validation": validation_s,
            "old_log_prob": metrics["timing_s/old_log_prob"],
            "update": metrics["timing_s/update_actor"],
            "metrics": {k: v for k, v in metrics.items() if k.startswith(("actor/ratio", "training/rollout_probs"))},
        }


def _graphs() -> int:
    return FlowPolicy.torch_compile_stats()["graphs"]


def compile_stack_s() -> float:
    """The first compile of a process pays once for Dynamo / Inductor themselves (imports, the compile workers):
    timed on a one-op function, before any model. In the main job the rollout worker and the training actor are
    two processes, so each side pays it; the projection adds it to each."""
    x = torch.ones(4)
    t0 = time.perf_counter()
    torch.compile(lambda v: v * 2 + 1, dynamic=False)(x)
    return time.perf_counter() - t0


def first_compiled_calls(phases: Phases) -> dict[str, Any]:
    """The first compiled call of each phase, in the main job's order per process (the rollout worker: its first
    training rollout; the actor: old log-probs then the update of its first step), with the graphs Dynamo made;
    then validation's, which the rollout worker runs eager (its batch shape would compile for one use)."""
    phases.compiled(True)
    out: dict[str, Any] = {}
    before = _graphs()
    phases.traj, seconds = phases.generate(phases.train_params, PROMPTS)
    out["rollout"] = {"first_call_s": seconds, "graphs": _graphs() - before}
    torch.set_num_threads(TRAINING_THREADS)
    before = _graphs()
    phases.step += 1
    metrics = phases.actor.train_on(phases.traj, phases.advantages, phases.step)
    out["old_log_prob"] = {"first_call_s": metrics["timing_s/old_log_prob"]}
    out["update"] = {"first_call_s": metrics["timing_s/update_actor"]}
    out["actor_graphs"] = _graphs() - before  # old log-probs (no grad, eval) + update (grad, train): one call makes both
    out["first_update_metrics"] = {k: v for k, v in metrics.items() if k.startswith(("actor/ratio", "training/rollout_probs"))}
    phases.rollout.load_trainable_state(phases.actor.get_weights())
    before = _graphs()
    _, seconds = phases.generate(phases.val_params, VAL_PROMPTS)
    out["validation"] = {"first_call_s": seconds, "graphs": _graphs() - before}
    return out


def steady_state(phases: Phases, repeats: int) -> dict[str, Any]:
    times: dict[str, dict[str, list[float]]] = {mode: {p: [] for p in PHASES} for mode in ("eager", "compiled")}
    graphs_before = _graphs()
    for r in range(repeats):
        for mode in ("eager", "compiled") if r % 2 == 0 else ("compiled", "eager"):
            phases.compiled(mode == "compiled")
            result = phases.round()
            for p in PHASES:
                times[mode][p].append(result[p])
    summary: dict[str, Any] = {}
    for p in PHASES:
        eager, compiled = times["eager"][p], times["compiled"][p]
        summary[p] = {
            "eager_median_s": statistics.median(eager),
            "compiled_median_s": statistics.median(compiled),
            "eager_min_s": min(eager),
            "compiled_min_s": min(compiled),
            "speedup_median": statistics.median(eager) / statistics.median(compiled),
            "eager_s": eager,
            "compiled_s": compiled,
        }
    summary["graphs_made_in_steady_state"] = _graphs() - graphs_before  # recompiles after the first calls: 0 expected
    return summary


def numerics(phases: Phases) -> dict[str, Any]:
    """Compiled vs eager on one set of weights: velocity, and the rollout's log-probs against the recomputed old ones."""
    torch.set_num_threads(TRAINING_THREADS)
    trajs = {}
    for mode in ("eager", "compiled"):
        phases.compiled(mode == "compiled")
        trajs[mode], _ = phases.generate(phases.train_params, PROMPTS)
    torch.set_num_threads(TRAINING_THREADS)
    out: dict[str, Any] = {}
    for rollout_mode, traj in trajs.items():
        for actor_mode in ("eager", "compiled"):
            phases.actor.policy.torch_compile = actor_mode == "compiled"
            old = phases.actor._old_log_probs(traj)
            out[f"rollout_{rollout_mode}_actor_{actor_mode}_log_prob_max_abs_diff"] = (old - traj.log_probs).abs().max().item()
    part = trajs["eager"].index_select(torch.arange(phases.actor.config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu))
    velocities = {}
    for mode in ("eager", "compiled"):
        phases.actor.policy.torch_compile = mode == "compiled"
        with torch.no_grad():
            velocities[mode] = phases.actor.policy.velocity(part.latents[:, 0], part.timesteps[:, 0], part.cond)
    diff = (velocities["compiled"] - velocities["eager"]).abs()
    out["velocity_max_abs_diff"] = diff.max().item()
    out["velocity_max_abs"] = velocities["eager"].abs().max().item()
    out["final_latents_max_abs_diff"] = (trajs["compiled"].latents[:, -1] - trajs["eager"].latents[:, -1]).abs().max().item()
    images = trajs["compiled"].images != trajs["eager"].images
    out["image_values_that_differ"] = f"{int(images.sum())} of {images.numel()} uint8 values"
    return out


def child(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    config = load_config(overrides=[f"actor_rollout_ref.model.path={args.model}"])
    load = OtherCpuLoad()
    with load:
        t0 = time.perf_counter()
        phases = Phases(config, dynamic=args.variant == "dynamic")
        warmup = phases.round()  # eager: first-call costs that are not compiling (allocations, lazy imports)
        eager_first = {p: warmup[p] for p in PHASES}
        stack_s = compile_stack_s()
        first = first_compiled_calls(phases)
        steady = steady_state(phases, args.repeats)
        checks = numerics(phases)
    result = {
        "variant": args.variant,
        "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        "eager_first_call_s": eager_first,
        "compile_stack_s": stack_s,
        "first_compiled_call": first,
        "compile_s": {p: first[p]["first_call_s"] - steady[p]["eager_median_s"] for p in PHASES},
        "steady_state": steady,
        "numerics": checks,
        "compile_stats": FlowPolicy.torch_compile_stats(),
        "wall_s": time.perf_counter() - t0,
        "other_cpu_share": load.value,
    }
    Path(args.child_out).write_text(json.dumps(result, indent=1))
    return 0


# ----------------------------------------------------------------------------------- data-parallel check
# Small enough to compile quickly: 2 prompts x 4 samples, 32 px, 4 steps, one shuffled mini-batch, micro-batches of 2.
DP_OVERRIDES = [
    "trainer.device=cpu",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.shuffle=true",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.pipeline.height=32",
    "actor_rollout_ref.rollout.pipeline.width=32",
    "actor_rollout_ref.rollout.pipeline.num_inference_steps=4",
    "actor_rollout_ref.rollout.algo.sde_window_range=[0,3]",
]


def data_parallel_check(model: Path, strategies: list[str], steps: int = 2) -> dict[str, Any]:
    """Two `TrainingActor` ranks (gloo, 1 thread each) with the actor switch against one eager rank on the same
    trajectory: per step each rank's first ratio and grad norm, then the weights' largest relative difference per
    tensor and each rank's torch.compile counters. Starts and stops its own local Ray cluster."""
    import ray

    from omni_core.rollout.sampler import generate
    from omni_core.workers.training_ranks import TrainingRanks

    torch.set_num_threads(1)
    base = [f"actor_rollout_ref.model.path={model}", *DP_OVERRIDES]
    one = load_config(overrides=base)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.5, -0.5])
    rollout = FlowPolicy.from_model_config(one.actor_rollout_ref.model, **rollout_policy_kwargs(one, None))
    params = SamplingParams.for_training(one.actor_rollout_ref.rollout)
    traj = generate(rollout, PROMPTS, prompt_indices=[0, 1], **params.generate_kwargs(1))
    out: dict[str, Any] = {"config": base}
    ray.init(address="local", num_cpus=16, include_dashboard=False, log_to_driver=False, namespace="bench-compile")
    try:
        for strategy in strategies:
            ranked = ["trainer.n_gpus_per_node=2", f"actor_rollout_ref.actor.strategy={strategy}"]
            config = load_config(overrides=[*base, *ranked, "actor_rollout_ref.actor.use_torch_compile=true"]).model_dump(
                mode="json"
            )
            single = TrainingActor(one.model_dump(mode="json"), steps, 1)
            remote = ray.remote(num_cpus=0)(TrainingActor)
            ranks = TrainingRanks([remote.remote(config, steps, 1, rank=r, world_size=2) for r in range(2)], strategy)
            try:
                ranks.form_group(600)
                per_step = []
                for step in range(1, steps + 1):
                    t0 = time.perf_counter()
                    needed = ray.get([h.local_samples.remote(traj.batch_size, step) for h in ranks.handles])
                    calls = [
                        h.train_on.remote(traj.index_select(torch.tensor(n)), advantages, step, samples=n)
                        for h, n in zip(ranks.handles, needed, strict=True)
                    ]
                    metrics = ray.get(calls, timeout=1800)
                    eager = single.train_on(traj, advantages, step)
                    per_step.append(
                        {
                            "seconds": time.perf_counter() - t0,
                            "ratio_mean_per_rank": [m["actor/ratio_mean"] for m in metrics],
                            "ratio_std_per_rank": [m["actor/ratio_std"] for m in metrics],
                            "grad_norm_per_rank": [m["actor/grad_norm"] for m in metrics],
                            "grad_norm_one_eager_rank": eager["actor/grad_norm"],
                        }
                    )
                gathered, after = ray.get(ranks.weights_ref(600)), single.get_weights()
                worst = max(float((gathered[k] - w).norm() / w.norm()) for k, w in after.items() if w.norm() > 0)
                out[strategy] = {
                    "steps": per_step,
                    "weights_max_relative_difference_vs_one_eager_rank": worst,
                    "compile_stats_per_rank": ray.get([h.torch_compile_stats.remote() for h in ranks.handles]),
                }
            finally:
                ranks.kill()
    finally:
        ray.shutdown()
    return out


# ---------------------------------------------------------------------------------------------- parent
def run_child(model: Path, variant: str, cache_dir: Path, repeats: int, out: Path, timeout_s: float) -> dict[str, Any]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    command = [sys.executable, __file__, "--child", "--variant", variant, "--model", str(model)]
    command += ["--repeats", str(repeats), "--child-out", str(out)]
    loadavg = [round(x, 2) for x in os.getloadavg()]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(out.read_text())
    result["loadavg_at_start"] = loadavg
    result["cache_mb"] = round(sum(f.stat().st_size for f in cache_dir.rglob("*") if f.is_file()) / 2**20, 1)
    return result


def projection(result: dict[str, Any]) -> dict[str, Any]:
    """The main job with each switch: compile seconds (each side's process pays `compile_stack_s` once) against the
    saving over 24 steps. Validation is not in it: the rollout worker runs validation requests eager."""
    steady, compile_s, stack = result["steady_state"], result["compile_s"], result["compile_stack_s"]

    def saving(p: str) -> float:
        return steady[p]["eager_median_s"] - steady[p]["compiled_median_s"]

    out = {}
    for switch, phases, processes in (("actor", ACTOR_PHASES, 1), ("rollout", ("rollout",), 1), ("both", TRAINING_PHASES, 2)):
        cost = processes * stack + sum(compile_s[p] for p in phases)
        per_step = sum(saving(p) for p in phases)
        saved = MAIN_JOB_STEPS * per_step
        out[switch] = {
            "compile_s": cost,
            "saved_s": saved,
            "net_s": cost - saved,  # > 0: the main job is slower with this switch on
            "per_step_saving_s": per_step,
            "break_even_steps": cost / per_step if per_step > 0 else None,
        }
    val = result["first_compiled_call"]["validation"]["first_call_s"] - steady["validation"]["eager_median_s"]
    out["validation_if_compiled"] = {"compile_s": val, "saved_per_validation_s": saving("validation")}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "compile.json"))
    parser.add_argument("--repeats", type=int, default=7, help="steady-state rounds (each: every phase eager and compiled)")
    parser.add_argument("--variants", nargs="*", choices=["static", "dynamic"], default=["static", "dynamic"])
    parser.add_argument("--model", default=None, help="diffusers folder (default: models/tiny-sd3, built if absent)")
    parser.add_argument("--work-dir", default=None, help="folder of the Inductor caches (default: a temporary one)")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per child process")
    parser.add_argument(
        "--data-parallel",
        nargs="*",
        choices=["ddp", "fsdp2"],
        default=None,
        help="also check 2 ranks of these strategies with the actor switch (starts a local Ray cluster); no value: both",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="static", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="omniflow-bench-compile-"))
    work.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else REPO / "models" / "tiny-sd3"
    if not (model / "model_index.json").is_file():
        model = build_tiny_pipeline(work / "tiny-sd3", "sd3", seed=0)
    machine = _machine()
    t0 = time.perf_counter()
    variants: dict[str, Any] = {}
    for variant in args.variants:
        cache = work / f"inductor-{variant}"
        shutil.rmtree(cache, ignore_errors=True)
        runs = {}
        for state in ("cold", "warm"):  # the same folder: the warm child is a second start of the run
            runs[state] = run_child(model, variant, cache, args.repeats, work / f"{variant}-{state}.json", args.timeout_s)
            runs[state]["projection"] = projection(runs[state])
            _print_run(variant, state, runs[state])
        variants[variant] = runs
    data_parallel = None
    if args.data_parallel is not None:
        data_parallel = data_parallel_check(model, args.data_parallel or ["ddp", "fsdp2"])
        print(f"data parallel: {json.dumps({k: v for k, v in data_parallel.items() if k != 'config'})}", flush=True)
    machine["loadavg_end"] = list(os.getloadavg())
    result = {
        "schema_version": SCHEMA_VERSION,
        "workload": "the defaults (make run): 2 prompts x 8 samples, 64 px, 10 steps, window 2, micro-batch 8, fp32",
        "main_job_steps": MAIN_JOB_STEPS,
        "threads": {"rollout": ROLLOUT_THREADS, "training": TRAINING_THREADS},
        "inductor_default_cache_dir": _default_cache_dir(),
        "variants": variants,
        "data_parallel": data_parallel,
        "versions": _versions(),
        "machine": machine,
        "wall_s": time.perf_counter() - t0,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


def _default_cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return default_cache_dir()


def _print_run(variant: str, state: str, run: dict[str, Any]) -> None:
    steady = run["steady_state"]
    cells = ", ".join(
        f"{p} {steady[p]['eager_median_s']:.3f}->{steady[p]['compiled_median_s']:.3f}s (compile {run['compile_s'][p]:.1f}s)"
        for p in PHASES
    )
    both = run["projection"]["both"]
    print(
        f"{variant}/{state}: {cells}; both switches: compile {both['compile_s']:.1f}s vs saved {both['saved_s']:.1f}s "
        f"-> net {both['net_s']:+.1f}s; other CPU {run['other_cpu_share']}; load {run['loadavg_at_start']}",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
