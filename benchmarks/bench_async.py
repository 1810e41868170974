#!/usr/bin/env python
"""sync vs separate_async on the tiny model: samples/s, idle shares, staleness and reward per sample (issue 13).

The real entry point runs once per mode as a subprocess, one after the other, with the same config, seed and
number of steps (so the same prompts per step and the same per-sample noise seeds):

1. **sync** (`trainer.v1.trainer_mode=sync`): rollout, then training, taking turns on the 2 cores. By default
   `actor_rollout_ref.rollout.agent.num_workers=2` (two single-thread rollout workers), so that both cores work
   in each phase as the issue asks; the training actor gets `cores // ranks` = 2 threads
   (`omni_core.trainers.base`). `--sync-rollout-workers 2 1` also runs the project's default of one worker (compared too).
2. **separate_async** (`trainer.v1.trainer_mode=separate_async actor_rollout_ref.rollout.nnodes=1`): one
   standalone single-thread rollout worker samples the next batch while the training actor (the other core)
   trains; `num_warmup_batches` and `parameter_sync_step` default to 1, `max_off_policy_threshold` to 2 (verl's span:
   a batch put one step ahead is trained 2 steps after its submission).

Shared by both: `algorithm.rollout_correction.bypass_mode=true` (required by separate_async; in sync the
rollout's log-probs are the on-policy ones, so it only skips the recompute; `--sync-bypass false` recomputes),
`data.train_batch_size == actor_rollout_ref.actor.ppo_mini_batch_size` (the project default, 2),
`trainer.logger=[console,file]`, and validation only before step 1 and after the last step (`--val-n` samples per
held-out prompt, noise level 0; `--val-n 0` turns it off), kept out of the timing. Each subprocess has its
own `PREFECT_HOME` (fresh) and no `PREFECT_API_URL` / `RAY_ADDRESS`, so it starts its embedded Prefect server, a
local Ray cluster and TransferQueue as `make run` does.

Measured per run, from its `metrics.jsonl` and a monitor thread (every `--sample-s`):
- steady samples/s = samples of steps 2..N / the sum of their `timing_s/step`;
- the same over the steps that are not the first of an epoch (an epoch's checkpoint waits for the requests
  queued, and before the queue was kept across epoch ends the pipeline drained there);
- window samples/s = the same samples / the wall time between the appearance of step 1's record and the last
  step's record in `metrics.jsonl` (includes epoch boundaries: checkpoint, the next `fit_epoch` task, the async
  queue's record and put-back, which step times leave out);
- CPU cores busy per role in that window (training actor, rollout workers, the rest of the run's process tree,
  and processes outside it), from the processes' own CPU times: an independent check of the idle shares;
- idle shares: async logs `perf/idle_share/{training,rollout}`; for sync they follow from the step timing
  (training waits during `gen`, the rollout is idle outside it);
- staleness (async), and the reward curve per sample: per step `critic/rewards/mean` with cumulative samples;
- the validation reward before and after training (the final weights on the same held-out prompts and seeds).

Comparison: the ratio async / sync of both samples/s figures, `target_met` = steady ratio >= `--target`
(computed, not asserted), and the reward: per-step paired differences async - sync (same prompts and noise
seeds per step, so the difference comes from the weights only), their mean over steps 2..N with a standard
error, `within_noise` = |mean| <= 2 standard errors, and each mode's reward gain from its first epoch's mean to its
last (every epoch covers the same prompts; steps within an epoch do not).
One run per mode (`"runs": 1` in the JSON): no run-to-run spread is measured.

The machine must be quiet: before each run the script waits (bounded) for the 1-minute load average to fall
below `--max-load` and for no other Ray cluster, and records the load.

    python benchmarks/bench_async.py [--epochs 2] [--sync-rollout-workers 2] [--out benchmarks/results/async.json] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_flow import _cpu_ticks, _git_rev, _label, _machine, _versions, wait_for_quiet  # noqa: E402

SCHEMA_VERSION = 1
STEP_KEY, SAMPLES_KEY, REWARD_KEY = "timing_s/step", "perf/total_num_images", "critic/rewards/mean"
STALENESS_KEY = "training/off_policy/trajectory_staleness"
ASYNC_IDLE_KEYS = ("perf/idle_share/training", "perf/idle_share/rollout")
TESTING_KEY, VAL_PREFIX = "timing_s/testing", "val-core/"
VALIDATE_AT_THE_END_ONLY = 1_000_000  # trainer.test_freq: validation runs at multiples of it and at the last step


# ------------------------------------------------------------------------------------------ the runs
def validation_overrides(val_n: int) -> list[str]:
    """Validation before the first step and after the last one only (`val_n` samples per held-out prompt);
    none when `val_n` is 0. Both stay out of the timing: step 0's is before step 1, the last step's
    `timing_s/testing` is subtracted."""
    if val_n <= 0:
        return ["trainer.val_before_train=false", "trainer.test_freq=-1"]
    return [
        "trainer.val_before_train=true",
        f"trainer.test_freq={VALIDATE_AT_THE_END_ONLY}",
        f"actor_rollout_ref.rollout.val_kwargs.n={val_n}",
    ]


def mode_overrides(mode: str, args: argparse.Namespace, sync_workers: int = 1) -> list[str]:
    """The overrides that make a run `mode` (shared ones are added by the caller)."""
    if mode == "sync":
        keys = ["trainer.v1.trainer_mode=sync", f"actor_rollout_ref.rollout.agent.num_workers={sync_workers}"]
        if args.sync_bypass == "false":
            keys.append("algorithm.rollout_correction.bypass_mode=false")
        return keys
    return [
        "trainer.v1.trainer_mode=separate_async",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
        f"trainer.v1.separate_async.num_warmup_batches={args.num_warmup_batches}",
        f"trainer.v1.separate_async.parameter_sync_step={args.parameter_sync_step}",
        f"trainer.v1.sampler.max_off_policy_threshold={args.max_off_policy_threshold}",
    ]


def _role(label: str) -> str:
    if "TrainingActor" in label:
        return "training_actor"
    if "RolloutWorker" in label:
        return "rollout_workers"
    return "rest_of_run"


class RunMonitor(threading.Thread):
    """Follows a run's process tree and its metrics.jsonl: when a step's record appears, stamps the time and
    snapshots the CPU seconds used so far per role and by the whole machine."""

    def __init__(self, root_pid: int, logs_dir: Path, interval_s: float, t0: float):
        super().__init__(daemon=True)
        self.root_pid, self.logs_dir, self.interval_s, self.t0 = root_pid, logs_dir, interval_s, t0
        self.stop_event = threading.Event()
        self.procs: dict[int, psutil.Process] = {}
        self.cpu_s: dict[int, float] = {}  # last seen user+system CPU seconds per process (kept after it exits)
        self.roles: dict[int, str] = {}
        self.labels_seen: set[str] = set()
        self.records_seen = 0
        self.stamps: list[dict[str, Any]] = []  # one per metrics.jsonl line, in order of appearance

    def _refresh_tree(self) -> None:
        children: dict[int, list[int]] = {}
        for proc in psutil.process_iter(["ppid"]):
            if proc.info["ppid"] is not None:
                children.setdefault(proc.info["ppid"], []).append(proc.pid)
        todo = [self.root_pid, *self.procs]
        while todo:
            pid = todo.pop()
            if pid not in self.procs:
                try:
                    self.procs[pid] = psutil.Process(pid)
                except psutil.Error:
                    continue
            todo.extend(k for k in children.get(pid, ()) if k not in self.procs)

    def _read_cpu(self) -> None:
        for pid, proc in list(self.procs.items()):
            try:
                times = proc.cpu_times()
                label = _label(proc)  # re-read: Ray workers exec and rename themselves
            except psutil.Error:
                continue
            self.cpu_s[pid] = times.user + times.system
            self.labels_seen.add(label)
            if label != "?":
                self.roles[pid] = _role(label)

    def cpu_by_role(self) -> dict[str, float]:
        out = {"training_actor": 0.0, "rollout_workers": 0.0, "rest_of_run": 0.0}
        for pid, seconds in self.cpu_s.items():
            out[self.roles.get(pid, "rest_of_run")] += seconds
        return out

    def _count_records(self) -> int:
        files = sorted(self.logs_dir.glob("*/metrics.jsonl"))
        if not files:
            return 0
        try:
            return sum(1 for line in files[-1].read_text().splitlines() if line.strip())
        except OSError:
            return self.records_seen

    def sample(self) -> None:
        self._refresh_tree()
        self._read_cpu()
        count = self._count_records()
        if count > self.records_seen:
            t = round(time.monotonic() - self.t0, 3)
            snapshot = {"t_s": t, "cpu_s_by_role": self.cpu_by_role(), "machine_ticks": _cpu_ticks()}
            for index in range(self.records_seen, count):
                self.stamps.append({"line": index, **snapshot})
            self.records_seen = count

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.sample()
            self.stop_event.wait(self.interval_s)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=30)
        self.sample()  # a record written in the last interval


def run_flow(name: str, overrides: list[str], workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One run of the real entry point as a subprocess; returns its records, stamps and raw figures."""
    local_dir = workdir / "ckpt"
    flow_overrides = [*overrides, f"trainer.default_local_dir={local_dir}"]
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "RAY_ADDRESS")}
    env.update(PREFECT_HOME=str(workdir / "prefect"), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "omniflow.flows.main_diffusion_v1", *flow_overrides]
    print(f"bench_async: {name}: {' '.join(cmd)}", flush=True)
    workdir.mkdir(parents=True, exist_ok=True)
    loadavg_before = [round(x, 2) for x in os.getloadavg()]
    t0 = time.monotonic()
    log_path = workdir / "run.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        monitor = RunMonitor(proc.pid, local_dir / "logs", args.sample_s, t0)
        monitor.start()
        try:
            rc = proc.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()
            rc = proc.wait(timeout=120)
        wall = time.monotonic() - t0
        monitor.stop()
    leftovers = [p.pid for p in monitor.procs.values() if _alive(p)]
    jsonls = sorted((local_dir / "logs").glob("*/metrics.jsonl"))
    lines = [line for line in jsonls[-1].read_text().splitlines() if line.strip()] if jsonls else []
    records, val_records = [], []
    for index, line in enumerate(lines):  # the monitor stamps non-empty lines in the same order
        record = json.loads(line)
        if STEP_KEY in record:  # a training step (validation-only records have no step time)
            record["_stamp"] = monitor.stamps[index] if index < len(monitor.stamps) else None
            records.append(record)
        else:
            val_records.append(record)
    records.sort(key=lambda r: r["step"])
    return {
        "command": " ".join(["python", "-m", "omniflow.flows.main_diffusion_v1", *flow_overrides]),
        "returncode": rc,
        "wall_s": round(wall, 2),
        "loadavg_before": loadavg_before,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "records": records,
        "val_records": val_records,
        "process_labels_seen": sorted(monitor.labels_seen),
        "processes_alive_after_exit": leftovers,
        "log_tail": log_path.read_text().splitlines()[-60:],
    }


def _git_status() -> list[str]:
    """Files changed in the working tree the runs used (other people's work in progress shows here)."""
    out = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, timeout=10)
    return [line for line in out.stdout.splitlines() if line.strip()]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# ------------------------------------------------------------------------------------------ figures
def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _step_s(record: dict[str, Any]) -> float:
    """A step's time without the validation it ran (`timing_s/testing`, the last step only here)."""
    return record[STEP_KEY] - record.get(TESTING_KEY, 0.0)


def _window(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Wall time and CPU per role between the records of step 1 and of the last step that ran no validation
    (by the monitor's stamps)."""
    last_index = max((i for i, r in enumerate(records) if TESTING_KEY not in r), default=0)
    first, last = records[0].get("_stamp"), records[last_index].get("_stamp")
    if not first or not last or last["t_s"] <= first["t_s"]:
        return {"available": False}
    wall = last["t_s"] - first["t_s"]
    samples = sum(r[SAMPLES_KEY] for r in records[1 : last_index + 1])
    cpu = {k: last["cpu_s_by_role"][k] - first["cpu_s_by_role"][k] for k in first["cpu_s_by_role"]}
    out: dict[str, Any] = {
        "available": True,
        "steps": [r["step"] for r in records[1 : last_index + 1]],
        "first_to_last_record_wall_s": round(wall, 3),
        "samples": samples,
        "samples_per_s": samples / wall,
        "cores_busy": {role: round(seconds / wall, 3) for role, seconds in cpu.items()},
    }
    ticks0, ticks1 = first["machine_ticks"], last["machine_ticks"]
    if ticks0 and ticks1 and ticks1[0] > ticks0[0]:
        hz = os.sysconf("SC_CLK_TCK")
        busy_s = (ticks1[1] - ticks0[1]) / hz
        cores = (ticks1[0] - ticks0[0]) / hz / wall  # /proc/stat counts every CPU
        out["cores_busy"]["outside_run"] = round(max(0.0, busy_s - sum(cpu.values())) / wall, 3)
        out["other_processes_cpu_share"] = round(min(1.0, max(0.0, busy_s - sum(cpu.values())) / (cores * wall)), 3)
    out["stamp_resolution_s"] = "the monitor's sampling interval (--sample-s) at each end"
    return out


def _without_epoch_starts(records: list[dict[str, Any]], steps_per_epoch: int) -> dict[str, Any]:
    """samples/s over the steps that are not the first of an epoch (epoch boundaries hold the checkpoint's wait for
    the queued requests and the next fit_epoch's start); the others show the pipelined rate."""
    kept = [r for r in records if (r["step"] - 1) % steps_per_epoch]
    seconds = sum(_step_s(r) for r in kept)
    return {
        "steps": [r["step"] for r in kept],
        "samples_per_s": sum(r[SAMPLES_KEY] for r in kept) / seconds if seconds > 0 else None,
    }


def _validation(val_records: list[dict[str, Any]], records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Validation rewards before training (step 0) and after the last step: the same held-out prompts and
    noise seeds (noise level 0) in every run, so the gain compares what the two modes learned."""
    before = next((r for r in val_records if r["step"] == 0), None)
    after = records[-1] if records and TESTING_KEY in records[-1] else None
    if before is None or after is None:
        return None
    keys = sorted(k for k in after if k.startswith(VAL_PREFIX) and "/reward/" in k)
    return {
        "before": {k: before.get(k) for k in keys},
        "after": {k: after[k] for k in keys},
        "gain": {k: after[k] - before[k] for k in keys if k in before},
        "after_step": after["step"],
    }


def summarise(run: dict[str, Any], last_k: int, steps_per_epoch: int) -> dict[str, Any]:
    """The figures of one run from its step records."""
    records = run["records"]
    later = records[1:]
    steady_samples = sum(r[SAMPLES_KEY] for r in later)
    steady_s = sum(_step_s(r) for r in later)
    cumulative, curve = 0.0, []
    for r in records:
        cumulative += r[SAMPLES_KEY]
        point = {"step": r["step"], "samples": cumulative, "reward_mean": r[REWARD_KEY]}
        if f"{STALENESS_KEY}/mean" in r:
            point["staleness_mean"] = r[f"{STALENESS_KEY}/mean"]
        curve.append(point)
    timing = {
        k.removeprefix("timing_s/"): _mean([r[k] for r in later if k in r])
        for k in sorted({k for r in records for k in r if k.startswith("timing_s/")})
    }
    plain = [r for r in later if TESTING_KEY not in r]  # the step that validates is left out of the shares
    if all(k in r for r in plain for k in ASYNC_IDLE_KEYS):
        idle = {k.rsplit("/", 1)[1]: _mean([r[k] for r in plain]) for k in ASYNC_IDLE_KEYS}
        idle_how = "mean over steps 2..N without validation of the logged perf/idle_share/{training,rollout}"
    else:
        gen_share = [r["timing_s/gen"] / r[STEP_KEY] for r in plain if r[STEP_KEY] > 0]
        idle = {"training": _mean(gen_share), "rollout": _mean([1.0 - s for s in gen_share])}
        idle_how = "sync: training idle = timing_s/gen / timing_s/step, rollout idle = 1 - that (steps 2..N without validation)"
    staleness = None
    if later and f"{STALENESS_KEY}/mean" in later[0]:
        staleness = {
            "mean": _mean([r[f"{STALENESS_KEY}/mean"] for r in later]),
            "max": max(r[f"{STALENESS_KEY}/max"] for r in later),
            "min": min(r[f"{STALENESS_KEY}/min"] for r in later),
            "per_step_mean": [r[f"{STALENESS_KEY}/mean"] for r in records],
            "evicted_groups": sum(r.get("training/off_policy/evicted_samples", 0.0) for r in records),
        }
    rewards = [r[REWARD_KEY] for r in records]
    k = min(last_k, len(rewards))
    epochs = [rewards[i : i + steps_per_epoch] for i in range(0, len(rewards), steps_per_epoch)]
    epoch_means = [sum(e) / len(e) for e in epochs if len(e) == steps_per_epoch]
    return {
        "command": run["command"],
        "returncode": run["returncode"],
        "wall_s": run["wall_s"],
        "loadavg_before": run["loadavg_before"],
        "loadavg_after": run["loadavg_after"],
        "steps": len(records),
        "samples_total": sum(r[SAMPLES_KEY] for r in records),
        "steady": {
            "steps": len(later),
            "samples": steady_samples,
            "step_s_sum": round(steady_s, 4),
            "samples_per_s": steady_samples / steady_s if steady_s > 0 else None,
            "how": "samples of steps 2..N / sum of their timing_s/step (minus timing_s/testing)",
        },
        "without_epoch_first_steps": _without_epoch_starts(records, steps_per_epoch),
        "window": _window(records),
        "step_s": [round(r[STEP_KEY], 4) for r in records],
        "validation": _validation(run["val_records"], records),
        "mean_timing_s_steps_2_to_n": timing,
        "idle_share": {**idle, "how": idle_how},
        "staleness": staleness,
        "reward_curve": curve,
        "reward_last_k": {"k": k, "mean": _mean(rewards[-k:]) if k else None},
        # Every epoch trains on the same prompt set (reshuffled), so epoch means compare like with like; the
        # steps of one epoch have different prompts, which dominates step-to-step reward differences.
        "reward_epoch_means": epoch_means,
        "reward_gain_last_epoch_minus_first": epoch_means[-1] - epoch_means[0] if epoch_means else None,
        "process_labels_seen": run["process_labels_seen"],
        "processes_alive_after_exit": run["processes_alive_after_exit"],
    }


def compare(sync: dict[str, Any], other: dict[str, Any], target: float, last_k: int) -> dict[str, Any]:
    """async / sync samples/s and the reward per sample, paired step by step."""
    steady = other["steady"]["samples_per_s"] / sync["steady"]["samples_per_s"]
    window = (
        other["window"]["samples_per_s"] / sync["window"]["samples_per_s"]
        if other["window"]["available"] and sync["window"]["available"]
        else None
    )
    sync_curve, async_curve = sync["reward_curve"], other["reward_curve"]
    same_samples = [p["samples"] for p in sync_curve] == [p["samples"] for p in async_curve]
    diffs = [a["reward_mean"] - s["reward_mean"] for s, a in zip(sync_curve, async_curve, strict=False)]
    later = diffs[1:]
    mean_diff = _mean(later)
    se = statistics.stdev(later) / math.sqrt(len(later)) if len(later) >= 2 else None
    k = min(last_k, len(diffs))
    pipelined = [m["without_epoch_first_steps"]["samples_per_s"] for m in (other, sync)]
    val_s, val_a = sync["validation"], other["validation"]
    validation = None
    if val_s and val_a:
        validation = {
            "after_async_minus_sync": {key: val_a["after"][key] - val_s["after"][key] for key in val_s["after"]},
            "before_equal": val_s["before"] == val_a["before"],
            "gain_sync": val_s["gain"],
            "gain_async": val_a["gain"],
            "how": "held-out prompts at noise level 0, the same seeds in both runs, scored with the final weights",
        }
    return {
        "steady_samples_per_s_async_over_sync": steady,
        "without_epoch_first_steps_async_over_sync": pipelined[0] / pipelined[1] if all(pipelined) else None,
        "window_samples_per_s_async_over_sync": window,
        "target": target,
        "target_met": steady >= target,
        "target_met_by_window": None if window is None else window >= target,
        "reward": {
            "same_samples_per_step": same_samples,
            "paired_diff_per_step_async_minus_sync": diffs,
            "step1_diff": diffs[0] if diffs else None,
            "mean_diff_steps_2_to_n": mean_diff,
            "standard_error": se,
            "within_noise": None if se is None or mean_diff is None else abs(mean_diff) <= 2 * se,
            "mean_diff_last_k": _mean(diffs[-k:]) if k else None,
            "sync_gain_last_epoch_minus_first": sync["reward_gain_last_epoch_minus_first"],
            "async_gain_last_epoch_minus_first": other["reward_gain_last_epoch_minus_first"],
            "how": (
                "same prompts and per-sample noise seeds per step in both modes (same seed), so step k's reward "
                "difference comes from the weights only (step 1: identical weights, difference 0). within_noise: "
                "|mean over steps 2..N| <= 2 standard errors (std of the per-step differences / sqrt(N-1)); the "
                "differences are not independent (weights drift apart), so this is a rough test. With staleness s "
                "a step's samples come from weights s updates older than sync's, so the async training-reward "
                "curve lags by about s steps of improvement even if learning per sample were the same: the "
                "validation comparison (final weights, same held-out prompts) does not have that lag"
            ),
        },
        "validation": validation,
    }


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides given to every run")
    parser.add_argument("--epochs", type=int, default=2, help="trainer.total_epochs (default 2 = 8 steps of 16 samples)")
    parser.add_argument(
        "--sync-rollout-workers",
        type=int,
        nargs="+",
        default=[2],
        help="sync runs, by rollout.agent.num_workers (default 2: both cores in the rollout phase too); the first is the baseline",
    )
    parser.add_argument("--sync-bypass", choices=["true", "false"], default="true", help="bypass_mode in sync runs")
    parser.add_argument("--num-warmup-batches", type=int, default=1)
    parser.add_argument("--parameter-sync-step", type=int, default=1)
    parser.add_argument("--max-off-policy-threshold", type=int, default=2)
    parser.add_argument("--last-k", type=int, default=4, help="steps of the final reward mean")
    parser.add_argument("--val-n", type=int, default=8, help="validation samples per held-out prompt (0: no validation)")
    parser.add_argument("--target", type=float, default=1.3, help="async / sync steady samples/s to reach")
    parser.add_argument("--model", default=str(REPO / "models" / "tiny-sd3"), help="tiny model folder (built if absent)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "async.json"), help="JSON result path")
    parser.add_argument("--sample-s", type=float, default=0.5, help="monitor interval (step-record stamps, CPU)")
    parser.add_argument("--max-load", type=float, default=1.5, help="wait until the 1-min load average is below this")
    parser.add_argument("--max-wait-s", type=float, default=600.0, help="longest wait for a quiet machine, per run")
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="limit per run")
    parser.add_argument("--keep-tmp", action="store_true", help="keep the temporary folder (logs, checkpoints)")
    args = parser.parse_args(argv)

    started = time.monotonic()
    model = Path(args.model).resolve()
    if not (model / "model_index.json").exists():
        subprocess.run([sys.executable, "-m", "omniflow.flows.cli", "make-tiny-model", str(model)], cwd=REPO, check=True)
    sys.path.insert(0, str(REPO))
    from omni_core.config import load_config

    shared = [
        f"actor_rollout_ref.model.path={model}",
        f"trainer.total_epochs={args.epochs}",
        "trainer.logger=[console,file]",
        "algorithm.rollout_correction.bypass_mode=true",
        *validation_overrides(args.val_n),
        *args.overrides,
    ]
    cfg = load_config(overrides=shared)
    batch, mini = cfg.data.train_batch_size, cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    if batch != mini:
        parser.error(f"data.train_batch_size={batch} must equal actor_rollout_ref.actor.ppo_mini_batch_size={mini}")
    # The baseline sync run, then separate_async right after it (the pair compared for the target), then any
    # further sync variants.
    syncs = [(f"sync_{w}_rollout_workers", mode_overrides("sync", args, w)) for w in args.sync_rollout_workers]
    plan = [syncs[0], ("separate_async", mode_overrides("separate_async", args)), *syncs[1:]]

    tmp = Path(tempfile.mkdtemp(prefix="omniflow-bench-async-"))
    runs: dict[str, dict[str, Any]] = {}
    quiet: dict[str, Any] = {}
    try:
        for name, keys in plan:
            quiet[name] = wait_for_quiet(args.max_load, args.max_wait_s, 30.0)
            run = run_flow(name, [*shared, *keys], tmp / name, args)
            if run["returncode"] != 0 or not run["records"]:
                sys.stdout.write("\n".join(run["log_tail"]) + "\n")
                print(f"bench_async: {name} failed (rc {run['returncode']}); log in {tmp / name / 'run.log'}", file=sys.stderr)
                args.keep_tmp = True
                return 1
            runs[name] = summarise(run, args.last_k, max(1, len(run["records"]) // args.epochs))
            s = runs[name]
            print(
                f"bench_async: {name}: {s['steps']} steps in {s['wall_s']:.0f} s, steady {s['steady']['samples_per_s']:.3f} samples/s",
                flush=True,
            )
    finally:
        if not args.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    comparisons = {name: compare(runs[name], runs["separate_async"], args.target, args.last_k) for name, _ in syncs}
    baseline = plan[0][0]
    rollout = cfg.actor_rollout_ref.rollout
    result = {
        "benchmark": "omniflow.sync_vs_separate_async",
        "schema_version": SCHEMA_VERSION,
        "runs": 1,
        "command": "python benchmarks/bench_async.py"
        + f" --epochs {args.epochs} --sync-rollout-workers {' '.join(map(str, args.sync_rollout_workers))}"
        + "".join(f" {o}" for o in args.overrides)
        + f" --out {args.out}",
        "timestamp_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git": _git_rev(),
        "git_status_porcelain": _git_status(),
        "versions": _versions(),
        "machine": {**_machine(), "quiet_wait_per_run": quiet, "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
        "config": {
            "shared_overrides": shared,
            "mode_overrides": dict(plan),
            "order": [name for name, _ in plan],
            "epochs": args.epochs,
            "train_batch_size": batch,
            "rollout_n": rollout.n,
            "samples_per_step": batch * rollout.n,
            "height": rollout.pipeline.height,
            "num_inference_steps": rollout.pipeline.num_inference_steps,
            "sde_window_size": rollout.algo.sde_window_size,
            "cores": os.cpu_count(),
            "threads": {
                "sync": "each rollout worker 1 torch thread; training actor cores // ranks (omni_core.trainers.base)",
                "separate_async": "rollout worker 1 torch thread; training actor (cores - 1) // ranks",
            },
        },
        "modes": runs,
        "comparison": comparisons,
        "baseline": baseline,
        "target_met": comparisons[baseline]["target_met"],
        "wall_s": round(time.monotonic() - started, 1),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    print()
    for name, s in runs.items():
        w = s["window"]
        print(
            f"{name:28s} steady {s['steady']['samples_per_s']:.3f} samples/s"
            + (f", window {w['samples_per_s']:.3f}" if w["available"] else "")
            + f"; idle training {s['idle_share']['training']:.2f}, rollout {s['idle_share']['rollout']:.2f}"
            + (f"; staleness mean {s['staleness']['mean']:.2f}" if s["staleness"] else "")
            + f"; reward last {s['reward_last_k']['k']} {s['reward_last_k']['mean']:.6f}"
        )
    for name, c in comparisons.items():
        r = c["reward"]
        print(
            f"async / {name}: steady {c['steady_samples_per_s_async_over_sync']:.3f}x"
            + (
                ""
                if c["window_samples_per_s_async_over_sync"] is None
                else f", window {c['window_samples_per_s_async_over_sync']:.3f}x"
            )
            + f", target {c['target']}x met: {c['target_met']}; reward diff {r['mean_diff_steps_2_to_n']:.2e}"
            + f" +- {r['standard_error'] or float('nan'):.2e} (within noise: {r['within_noise']})"
        )
        if c["validation"]:
            print(f"  validation after training, async - sync: {c['validation']['after_async_minus_sync']}")
            print(f"  validation gain sync {c['validation']['gain_sync']}, async {c['validation']['gain_async']}")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
