#!/usr/bin/env python
"""Orchestration overhead of the OmniFlow flow: the real entry point against a plain in-process loop.

One invocation, same config, same machine:

1. The flow end to end: ``python -m omniflow.flows.main_diffusion_v1 actor_rollout_ref.model.path=<tiny>
   trainer.total_epochs=E trainer.default_local_dir=<tmp> trainer.logger=[console,file]
   trainer.val_before_train=false [overrides]`` as a subprocess, with its own ``PREFECT_HOME`` (a temporary
   folder) and no ``PREFECT_API_URL``, so it starts its embedded Prefect server, a local Ray cluster and
   TransferQueue as ``make run`` does. Per-step metrics come from the ``metrics.jsonl`` it writes.
2. The same ``omni_core`` components in one plain process (``benchmarks/plain_loop.py``, no Prefect / Ray /
   TransferQueue), as a subprocess with the same overrides and the same number of steps.
3. Time from the command to the first training step: stdout is read line by line in a thread and stamped
   with ``time.monotonic()``; the first line containing ``step 1/`` marks the end of step 1. Then (unless
   ``--no-rerun``) the flow once more, one epoch, on the same ``PREFECT_HOME`` with a new checkpoint folder: a
   user's second run, whose tokenizer, dataset and prompt embeddings come from Prefect's cache (``rerun``).
4. Peak memory of each run, all processes: every ``--sample-s`` the sum of RSS (and PSS / USS from
   ``memory_full_info``) over the subprocess and all its descendants (Prefect server, Ray's gcs_server,
   raylet, workers, actors); a process seen once stays counted while alive, even if re-parented.

Steady-state images/s = images of steps 2..N / the sum of their step times (step 1 carries warm-up).
flow/plain is the orchestration overhead (1.0 = none). The machine must be quiet: the script waits for
the 1-minute load average to fall below ``--max-load`` (up to ``--max-wait-s``) and records the load.

    python benchmarks/bench_flow.py [--epochs 3] [--out benchmarks/results/flow.json] [key.path=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
SCHEMA_VERSION = 1
FIRST_STEP_MARK = "step 1/"


# ------------------------------------------------------------------------------------------ helpers
def _cpu_ticks() -> tuple[int, int] | None:
    """(total, busy) jiffies of all CPUs from /proc/stat, None where it is missing."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    total = sum(fields)
    return total, total - fields[3] - fields[4]


def _label(proc: psutil.Process) -> str:
    """A short name per process: Ray workers name themselves ``ray::Class`` in their command line."""
    try:
        cmd = proc.cmdline()
        name = proc.name()
    except (psutil.Error, OSError):
        return "?"
    if cmd and cmd[0].startswith("ray::"):
        return cmd[0].split()[0]
    if name.startswith("python") and len(cmd) > 1:
        rest = [c for c in cmd[1:] if not c.startswith("-")]
        head = " ".join(cmd[1:3]) if cmd[1] == "-m" else (Path(rest[0]).name if rest else name)
        if "prefect" in " ".join(cmd[:4]) and "server" in cmd:
            return "prefect server"
        if "uvicorn" in cmd[1:3]:
            return "prefect server (uvicorn)"
        return f"python {head}"
    if "prefect" in name:
        return "prefect server" if "server" in cmd else name
    return name


class TreeSampler(threading.Thread):
    """Samples the memory of a process and all its descendants until stopped.

    RSS counts shared pages (torch's libraries, Ray's object store) once per process, PSS splits them
    between the processes that share them: the sum of PSS is the machine's real footprint.
    """

    def __init__(self, root_pid: int, interval_s: float, on_sample: Any = None):
        super().__init__(daemon=True)
        self.root_pid, self.interval_s, self.on_sample = root_pid, interval_s, on_sample
        self.stop_event = threading.Event()
        self.procs: dict[int, psutil.Process] = {}
        self.labels: dict[int, str] = {}
        self.cpu_s: dict[int, float] = {}  # last seen user+system CPU seconds per process
        self.cpu_series: list[tuple[float, dict[int, float]]] = []  # (t, CPU seconds by pid so far)
        self.series: list[tuple[float, float, float | None, int]] = []  # (t, rss MB, pss MB, processes)
        self.peak_rss = 0.0
        self.peak_pss: float | None = None
        self.peak_uss: float | None = None
        self.peak_procs = 0
        self.peak_rss_breakdown: dict[str, float] = {}
        self.peak_pss_breakdown: dict[str, float] = {}
        self.pss_available = True
        self.sample_cost_s: list[float] = []
        self.t0 = time.monotonic()

    def _refresh(self) -> None:
        """Adds new descendants of the root and of every process seen before (one scan of /proc)."""
        children: dict[int, list[int]] = {}
        for proc in psutil.process_iter(["ppid"]):
            ppid = proc.info["ppid"]
            if ppid is not None:
                children.setdefault(ppid, []).append(proc.pid)
        todo = [self.root_pid, *self.procs]
        while todo:
            pid = todo.pop()
            if pid not in self.procs:
                try:
                    self.procs[pid] = psutil.Process(pid)
                except psutil.Error:
                    continue
            todo.extend(k for k in children.get(pid, ()) if k not in self.procs)

    def sample(self) -> None:
        start = time.monotonic()
        self._refresh()
        rss_by: dict[str, float] = {}
        pss_by: dict[str, float] = {}
        rss = pss = uss = 0.0
        alive = 0
        for pid, proc in list(self.procs.items()):
            try:
                if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                label = self.labels[pid] = _label(proc)  # re-read: Ray workers exec and rename themselves
                times = proc.cpu_times()
                self.cpu_s[pid] = times.user + times.system
                if self.pss_available:
                    try:
                        full = proc.memory_full_info()
                        p_rss, p_pss, p_uss = full.rss, getattr(full, "pss", None), full.uss
                    except (psutil.AccessDenied, AttributeError):
                        self.pss_available = False
                        p_rss, p_pss, p_uss = proc.memory_info().rss, None, None
                else:
                    p_rss, p_pss, p_uss = proc.memory_info().rss, None, None
            except psutil.Error:
                continue
            alive += 1
            rss += p_rss
            rss_by[label] = rss_by.get(label, 0.0) + p_rss / 2**20
            if p_pss is not None:
                pss += p_pss
                pss_by[label] = pss_by.get(label, 0.0) + p_pss / 2**20
            if p_uss is not None:
                uss += p_uss
        rss_mb, pss_mb, uss_mb = rss / 2**20, (pss / 2**20 if self.pss_available else None), uss / 2**20
        self.cpu_series.append((time.monotonic() - self.t0, dict(self.cpu_s)))
        self.series.append(
            (round(time.monotonic() - self.t0, 2), round(rss_mb, 1), None if pss_mb is None else round(pss_mb, 1), alive)
        )
        if rss_mb > self.peak_rss:
            self.peak_rss, self.peak_rss_breakdown = rss_mb, rss_by
        if pss_mb is not None and (self.peak_pss is None or pss_mb > self.peak_pss):
            self.peak_pss, self.peak_pss_breakdown, self.peak_procs = pss_mb, pss_by, alive
        if self.pss_available and (self.peak_uss is None or uss_mb > self.peak_uss):
            self.peak_uss = uss_mb
        self.sample_cost_s.append(time.monotonic() - start)
        if self.on_sample is not None:
            self.on_sample()

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.sample()
            self.stop_event.wait(self.interval_s)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=30)

    def cpu_share_between(self, t0: float, t1: float) -> dict[str, float]:
        """Each process's share of the machine's CPU between `t0` and `t1` (seconds since the sampler started), by
        its label without the Ray method it ran last (`ray::TrainingActor.generate` -> `ray::TrainingActor`): CPU
        seconds from the last samples at or before each time, over (t1 - t0) x the CPU count."""
        before = [c for t, c in self.cpu_series if t <= t0]
        after = [c for t, c in self.cpu_series if t <= t1]
        if not before or not after or t1 <= t0:
            return {}
        a, b = before[-1], after[-1]
        span = (t1 - t0) * (os.cpu_count() or 1)
        shares: dict[str, float] = {}
        for pid, cpu in b.items():
            label = self.labels.get(pid, "?")
            label = label.split(".")[0] if label.startswith("ray::") else label
            shares[label] = shares.get(label, 0.0) + (cpu - a.get(pid, 0.0)) / span
        return {k: round(v, 4) for k, v in sorted(shares.items(), key=lambda kv: -kv[1]) if v > 0}

    def summary(self) -> dict[str, Any]:
        def top(d: dict[str, float]) -> dict[str, float]:
            return {k: round(v, 1) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}

        step = max(1, len(self.series) // 200)  # at most ~200 points in the JSON
        return {
            "peak_rss_sum_mb": round(self.peak_rss, 1),
            "peak_pss_sum_mb": None if self.peak_pss is None else round(self.peak_pss, 1),
            "peak_uss_sum_mb": None if self.peak_uss is None else round(self.peak_uss, 1),
            "processes_at_peak_pss": self.peak_procs,
            "processes_seen": len(self.procs),
            "process_labels_seen": sorted(set(self.labels.values())),
            "rss_mb_by_process_at_peak_rss": top(self.peak_rss_breakdown),
            "pss_mb_by_process_at_peak_pss": top(self.peak_pss_breakdown),
            "samples": len(self.series),
            "sample_cost_s_median": sorted(self.sample_cost_s)[len(self.sample_cost_s) // 2] if self.sample_cost_s else None,
            "tree_cpu_s": round(sum(self.cpu_s.values()), 2),
            "series_t_rss_pss_nproc": self.series[::step],
        }


def run_monitored(
    cmd: list[str],
    env: dict[str, str],
    log_path: Path,
    interval_s: float,
    timeout_s: float,
    marks: dict[str, str],
    poll: Any = None,
) -> dict[str, Any]:
    """Runs `cmd`, reading its merged stdout/stderr line by line; returns timings, marks and memory."""
    ticks0 = _cpu_ticks()
    t_launch = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    sampler = TreeSampler(proc.pid, interval_s, on_sample=poll)
    sampler.start()
    found: dict[str, dict[str, Any]] = {}
    lines: list[tuple[float, str]] = []

    def reader() -> None:
        with log_path.open("w") as log:
            for line in proc.stdout:  # type: ignore[union-attr]
                t = time.monotonic() - t_launch
                line = line.rstrip("\n")
                lines.append((t, line))
                log.write(f"{t:9.3f} {line}\n")
                log.flush()
                for key, needle in marks.items():
                    if key not in found and needle in line:
                        found[key] = {"t_s": round(t, 3), "line": line[:300]}

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        rc = proc.wait(timeout=60)
    wall = time.monotonic() - t_launch
    thread.join(timeout=30)
    time.sleep(min(2.0, interval_s * 2))  # let the sampler see the tree wind down
    sampler.stop()
    ticks1 = _cpu_ticks()
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    other = None
    if ticks0 and ticks1 and ticks1[0] > ticks0[0]:
        total_s, busy_s = (ticks1[0] - ticks0[0]) / hz, (ticks1[1] - ticks0[1]) / hz
        other = min(1.0, max(0.0, (busy_s - sampler.summary()["tree_cpu_s"]) / total_s))
    leftovers = [p.pid for p in sampler.procs.values() if _alive(p)]
    return {
        "returncode": rc,
        "wall_s": round(wall, 3),
        "sampler": sampler,
        "marks": found,
        "lines": lines,
        "memory": sampler.summary(),
        "other_processes_cpu_share": None if other is None else round(other, 3),
        "processes_alive_after_exit": leftovers,
    }


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _steady(records: list[dict[str, float]], images_key: str, step_key: str) -> dict[str, Any]:
    """images/s over steps 2..N (step 1 is warm-up) plus the all-steps figure."""
    later = records[1:]
    imgs = sum(r[images_key] for r in later)
    secs = sum(r[step_key] for r in later)
    all_imgs = sum(r[images_key] for r in records)
    all_secs = sum(r[step_key] for r in records)
    step_times = [r[step_key] for r in records]
    return {
        "steps": len(records),
        "images_total": all_imgs,
        "first_step_s": round(step_times[0], 4) if step_times else None,
        "steady_steps": len(later),
        "steady_images": imgs,
        "steady_step_s_sum": round(secs, 4),
        "steady_step_s_mean": round(secs / len(later), 4) if later else None,
        "steady_step_s_median": round(sorted(step_times[1:])[len(later) // 2], 4) if later else None,
        "steady_images_per_s": imgs / secs if secs > 0 else None,
        "all_steps_images_per_s": all_imgs / all_secs if all_secs > 0 else None,
        "step_s": [round(s, 4) for s in step_times],
    }


def _mean(records: list[dict[str, float]], key: str) -> float | None:
    vals = [r[key] for r in records[1:] if key in r]
    return sum(vals) / len(vals) if vals else None


def rerun_start(flow_overrides: list[str], local_dir: Path, env: dict[str, str], tmp: Path, args: Any) -> dict[str, Any]:
    """The flow again, one epoch, on the first run's PREFECT_HOME (its database and Prefect's result cache) with a
    new checkpoint folder: how soon a user's second run trains."""
    overrides = [
        f"trainer.default_local_dir={local_dir}-rerun" if o.startswith("trainer.default_local_dir=") else o
        for o in flow_overrides
        if not o.startswith("trainer.total_epochs=")
    ] + ["trainer.total_epochs=1"]
    cmd = [sys.executable, "-m", "omniflow.flows.main_diffusion_v1", *overrides]
    print("bench_flow: rerun:", " ".join(cmd), flush=True)
    run = run_monitored(
        cmd,
        env,
        tmp / "rerun.log",
        args.sample_s,
        args.timeout_s,
        {"api_up": "omniflow: Prefect API", "first_step": FIRST_STEP_MARK},
    )
    return {
        "command": " ".join(["python", "-m", "omniflow.flows.main_diffusion_v1", *overrides]),
        "env": {"PREFECT_HOME": "<tmp>/prefect (the first run's)", "PREFECT_API_URL": "unset (embedded server)"},
        "returncode": run["returncode"],
        "command_to_api_up_s": run["marks"].get("api_up", {}).get("t_s"),
        "command_to_step1_done_s": run["marks"].get("first_step", {}).get("t_s"),
        "cached_tasks": sum("Finished in state Cached" in line for _, line in run["lines"]),
        "peak_pss_sum_mb": run["memory"]["peak_pss_sum_mb"],
        "other_processes_cpu_share": run["other_processes_cpu_share"],
    }


def _load1() -> float:
    return os.getloadavg()[0]


def _foreign_raylets() -> int:
    """Ray clusters already running (another run or test suite would share the CPUs)."""
    count = 0
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] == "raylet":
            count += 1
    return count


def wait_for_quiet(max_load: float, max_wait_s: float, every_s: float) -> dict[str, Any]:
    """Waits until the 1-min load average is below `max_load` and no other Ray cluster runs."""
    start = time.monotonic()
    checks = [(round(_load1(), 2), _foreign_raylets())]
    while (checks[-1][0] >= max_load or checks[-1][1]) and time.monotonic() - start < max_wait_s:
        print(
            f"bench_flow: load average {checks[-1][0]:.2f}, other Ray clusters {checks[-1][1]}; waiting {every_s:.0f} s",
            flush=True,
        )
        time.sleep(every_s)
        checks.append((round(_load1(), 2), _foreign_raylets()))
    return {
        "max_load": max_load,
        "waited_s": round(time.monotonic() - start, 1),
        "load_checks": [c[0] for c in checks],
        "other_ray_clusters_checks": [c[1] for c in checks],
        "quiet": checks[-1][0] < max_load and not checks[-1][1],
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("torch", "diffusers", "transformers", "prefect", "prefect-ray", "ray", "TransferQueue", "psutil"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None  # type: ignore[assignment]
    return out


def _machine() -> dict[str, Any]:
    mem = psutil.virtual_memory()
    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_total_gb": round(mem.total / 2**30, 2),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
    }


def _git_rev() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides, given to both the flow and the plain loop")
    parser.add_argument("--epochs", type=int, default=3, help="trainer.total_epochs of the flow (default 3 = 12 steps)")
    parser.add_argument("--model", default=str(REPO / "models" / "tiny-sd3"), help="tiny model folder (built if absent)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "flow.json"), help="JSON result path")
    parser.add_argument("--sample-s", type=float, default=0.5, help="memory sampling interval")
    parser.add_argument("--max-load", type=float, default=1.5, help="wait until the 1-min load average is below this")
    parser.add_argument("--max-wait-s", type=float, default=900.0, help="longest wait for a quiet machine (then run anyway)")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="limit per run")
    parser.add_argument("--keep-tmp", action="store_true", help="keep the temporary folder (logs, checkpoints, PREFECT_HOME)")
    parser.add_argument("--no-rerun", action="store_true", help="skip the second flow run on the same PREFECT_HOME")
    args = parser.parse_args(argv)

    started = time.monotonic()
    model = Path(args.model).resolve()
    model_built_s = None
    if not (model / "model_index.json").exists():
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "omniflow.flows.cli", "make-tiny-model", str(model)], cwd=REPO, check=True)
        model_built_s = round(time.monotonic() - t0, 2)

    sys.path.insert(0, str(REPO))
    from omni_core.config import load_config

    common = [f"actor_rollout_ref.model.path={model}", f"trainer.total_epochs={args.epochs}", *args.overrides]
    cfg = load_config(overrides=common)
    quiet = wait_for_quiet(args.max_load, args.max_wait_s, 60.0)
    print(f"bench_flow: load average {quiet['load_checks'][-1]:.2f} (waited {quiet['waited_s']:.0f} s); starting", flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="omniflow-bench-flow-"))
    try:
        local_dir = tmp / "ckpt"
        flow_overrides = [
            *common[:2],
            f"trainer.default_local_dir={local_dir}",
            "trainer.logger=[console,file]",
            "trainer.val_before_train=false",
            *args.overrides,
        ]
        env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
        env.update(PREFECT_HOME=str(tmp / "prefect"), PYTHONUNBUFFERED="1")
        flow_cmd = [sys.executable, "-m", "omniflow.flows.main_diffusion_v1", *flow_overrides]
        print("bench_flow: flow:", " ".join(flow_cmd), flush=True)

        # metrics.jsonl: the first record's appearance is a second, file-based "first step" stamp
        jsonl_first: dict[str, float] = {}
        t_flow = time.monotonic()

        def poll_jsonl() -> None:
            if "t_s" in jsonl_first:
                return
            for path in (local_dir / "logs").glob("*/metrics.jsonl"):
                if path.stat().st_size > 0:
                    jsonl_first["t_s"] = round(time.monotonic() - t_flow, 3)

        flow = run_monitored(
            flow_cmd,
            env,
            tmp / "flow.log",
            args.sample_s,
            args.timeout_s,
            {"api_up": "omniflow: Prefect API", "first_step": FIRST_STEP_MARK, "finished": "omniflow: run finished"},
            poll=poll_jsonl,
        )
        jsonls = sorted((local_dir / "logs").glob("*/metrics.jsonl"))
        if flow["returncode"] != 0 or not jsonls:
            sys.stdout.write("\n".join(line for _, line in flow["lines"][-60:]) + "\n")
            print(f"bench_flow: the flow failed (rc {flow['returncode']}); log in {tmp / 'flow.log'}", file=sys.stderr)
            args.keep_tmp = True
            return 1
        records = [json.loads(x) for x in jsonls[-1].read_text().splitlines() if x.strip()]
        records.sort(key=lambda r: r["step"])
        flow_steady = _steady(records, "perf/total_num_images", "timing_s/step")
        first_t = flow["marks"].get("first_step", {}).get("t_s")
        last_mark = f"step {len(records)}/{len(records)} "
        last_t = next((t for t, ln in flow["lines"] if last_mark in ln), None)
        window = {}
        if first_t is not None and last_t is not None and last_t > first_t:
            # wall clock between the end of step 1 and the end of the last step: includes epoch boundaries
            # (checkpoint save, the next fit_epoch task on Ray), which the sum of step times leaves out
            window = {
                "first_to_last_step_wall_s": round(last_t - first_t, 3),
                "images_per_s": flow_steady["steady_images"] / (last_t - first_t),
                "gap_outside_steps_s": round(last_t - first_t - flow_steady["steady_step_s_sum"], 3),
            }
            # What each process of the run took of the machine while it trained (steps 2..N): the training actor's
            # work and the rest of the run's "background" (Prefect server, fit_epoch, flow process, TQ, Ray daemons),
            # whose cost to a step that owns every core benchmarks/bench_background.py measures.
            shares = flow["sampler"].cpu_share_between(first_t, last_t)
            window["cpu_share_by_process"] = shares
            window["background_cpu_share"] = round(sum(v for k, v in shares.items() if "TrainingActor" not in k), 4)
        flow_result = {
            "command": " ".join(["python", "-m", "omniflow.flows.main_diffusion_v1", *flow_overrides]),
            "env": {"PREFECT_HOME": "<tmp>/prefect (fresh)", "PREFECT_API_URL": "unset (embedded server)"},
            "returncode": flow["returncode"],
            "wall_s": flow["wall_s"],
            "wall_images_per_s": flow_steady["images_total"] / flow["wall_s"],
            "steady_state": flow_steady,
            "training_window": window,
            "mean_timing_s_steps_2_to_n": {
                k.removeprefix("timing_s/"): _mean(records, k)
                for k in sorted({k for r in records for k in r if k.startswith("timing_s/")})
            },
            "time_to_first_step": {
                "command_to_step1_done_s": first_t,
                "command_to_step1_start_s": round(first_t - records[0]["timing_s/step"], 3) if first_t is not None else None,
                "command_to_api_up_s": flow["marks"].get("api_up", {}).get("t_s"),
                "command_to_metrics_jsonl_first_record_s": jsonl_first.get("t_s"),
                "first_step_line": flow["marks"].get("first_step", {}).get("line"),
                "how": "monotonic clock at Popen -> first merged stdout/stderr line containing 'step 1/' (printed at the end of step 1)",
            },
            "after_last_step_to_exit_s": round(flow["wall_s"] - last_t, 3) if last_t is not None else None,
            "reward_mean_first_last": [records[0].get("critic/rewards/mean"), records[-1].get("critic/rewards/mean")],
            "memory": flow["memory"],
            "other_processes_cpu_share": flow["other_processes_cpu_share"],
            "processes_alive_after_exit": flow["processes_alive_after_exit"],
        }
        print(
            f"bench_flow: flow done in {flow['wall_s']:.1f} s, {flow_steady['steps']} steps, "
            f"steady {flow_steady['steady_images_per_s']:.3f} images/s",
            flush=True,
        )

        # ---- the plain loop, same overrides and steps
        steps = len(records)
        plain_cmd = [sys.executable, str(REPO / "benchmarks" / "plain_loop.py"), *common, "--steps", str(steps)]
        plain_env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))}
        plain_env.setdefault("HF_HUB_OFFLINE", "1")
        plain_env.setdefault("TRANSFORMERS_OFFLINE", "1")
        print("bench_flow: plain:", " ".join(plain_cmd), flush=True)
        plain = run_monitored(
            plain_cmd, plain_env, tmp / "plain.log", args.sample_s, args.timeout_s, {"first_step": '"step": 1,'}
        )
        plain_records = []
        for _, line in plain["lines"]:
            if line.startswith("{"):
                try:
                    plain_records.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        if plain["returncode"] != 0 or len(plain_records) != steps:
            sys.stdout.write("\n".join(line for _, line in plain["lines"][-40:]) + "\n")
            print(f"bench_flow: the plain loop failed (rc {plain['returncode']})", file=sys.stderr)
            args.keep_tmp = True
            return 1
        plain_steady = _steady(plain_records, "images", "step_s")
        plain_result = {
            "command": " ".join(["python", "benchmarks/plain_loop.py", *common, "--steps", str(steps)]),
            "returncode": plain["returncode"],
            "wall_s": plain["wall_s"],
            "wall_images_per_s": plain_steady["images_total"] / plain["wall_s"],
            "steady_state": plain_steady,
            "mean_s_steps_2_to_n": {
                "gen": _mean(plain_records, "gen_s"),
                "update": _mean(plain_records, "update_s"),
                "old_log_prob": _mean(plain_records, "timing_s/old_log_prob"),
                "update_actor": _mean(plain_records, "timing_s/update_actor"),
            },
            "command_to_step1_done_s": plain["marks"].get("first_step", {}).get("t_s"),
            "reward_mean_first_last": [plain_records[0]["reward_mean"], plain_records[-1]["reward_mean"]],
            "memory": plain["memory"],
            "other_processes_cpu_share": plain["other_processes_cpu_share"],
        }

        rerun_result = None if args.no_rerun else rerun_start(flow_overrides, local_dir, env, tmp, args)

        f_ss, p_ss = flow_steady["steady_images_per_s"], plain_steady["steady_images_per_s"]
        ratios = {
            "steady_images_per_s_flow_over_plain": f_ss / p_ss,
            "steady_overhead_pct": 100.0 * (p_ss / f_ss - 1.0),  # extra time per step in the flow
            "wall_images_per_s_flow_over_plain": flow_result["wall_images_per_s"] / plain_result["wall_images_per_s"],
            "training_window_images_per_s_flow_over_plain": window["images_per_s"] / p_ss if window else None,
            "peak_pss_flow_over_plain": (
                flow["memory"]["peak_pss_sum_mb"] / plain["memory"]["peak_pss_sum_mb"]
                if flow["memory"]["peak_pss_sum_mb"] and plain["memory"]["peak_pss_sum_mb"]
                else None
            ),
            "time_to_first_step_flow_minus_plain_s": (
                round(first_t - plain_result["command_to_step1_done_s"], 3)
                if first_t is not None and plain_result["command_to_step1_done_s"] is not None
                else None
            ),
        }
        # Phase by phase, mean seconds of steps 2..N: where the flow's extra time goes.
        flow_t, plain_t = flow_result["mean_timing_s_steps_2_to_n"], plain_result["mean_s_steps_2_to_n"]
        phases = {
            "gen (rollout + reward + TQ put + replay-buffer wait)": [flow_t.get("gen"), plain_t["gen"]],
            "old_log_prob (incl. the TQ get of the batch)": [flow_t.get("old_log_prob"), plain_t["old_log_prob"]],
            "update_actor": [flow_t.get("update_actor"), plain_t["update_actor"]],
            "update_weights (push to the rollout workers)": [flow_t.get("update_weights"), 0.0],
            "step": [flow_t.get("step"), plain_steady["steady_step_s_mean"]],
        }
        peak_pss = flow["memory"]["peak_pss_sum_mb"]
        targets = {
            "steady_flow_over_plain_at_least_0.95": {"value": ratios["steady_images_per_s_flow_over_plain"], "target": 0.95},
            "command_to_first_step_done_s_at_most_25": {"value": first_t, "target": 25.0},
            "rerun_command_to_first_step_done_s_at_most_25": {
                "value": rerun_result["command_to_step1_done_s"] if rerun_result else None,
                "target": 25.0,
            },
            "peak_pss_mb_at_most_2048": {"value": peak_pss, "target": 2048.0},
        }
        for name, t in targets.items():
            t["met"] = (
                None if t["value"] is None else (t["value"] >= t["target"] if "at_least" in name else t["value"] <= t["target"])
            )
        rollout, batch = cfg.actor_rollout_ref.rollout, cfg.data.train_batch_size
        result = {
            "benchmark": "omniflow.flow_vs_plain",
            "schema_version": SCHEMA_VERSION,
            "command": "python benchmarks/bench_flow.py"
            + f" --epochs {args.epochs}"
            + "".join(f" {o}" for o in args.overrides)
            + f" --out {args.out}",
            "timestamp_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "git": _git_rev(),
            "versions": _versions(),
            "machine": {**_machine(), **quiet, "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
            "config": {
                "overrides_common": common,
                "model": str(model),
                "model_built_s": model_built_s,
                "epochs": args.epochs,
                "steps": steps,
                "train_batch_size": batch,
                "rollout_n": rollout.n,
                "images_per_step": batch * rollout.n,
                "height": rollout.pipeline.height,
                "num_inference_steps": rollout.pipeline.num_inference_steps,
                "sde_window_size": rollout.algo.sde_window_size,
                "trainer_mode": cfg.trainer.v1.trainer_mode,
                "order": "flow first, then the plain loop",
                "memory_sample_s": args.sample_s,
            },
            "flow": flow_result,
            "plain": plain_result,
            "rerun": rerun_result,
            "ratio": ratios,
            "phases_s_flow_plain": phases,
            "targets": targets,
            "wall_s": round(time.monotonic() - started, 1),
        }
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")

        def mb(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.0f} MB"

        tt = flow_result["time_to_first_step"]
        print()
        print(f"flow vs plain loop: {steps} steps x {batch * rollout.n} images, load {quiet['load_checks'][-1]:.2f} at start")
        print(
            f"  flow  steady {f_ss:.3f} images/s (step {flow_steady['steady_step_s_mean']:.2f} s), wall {flow_result['wall_images_per_s']:.3f} images/s ({flow['wall_s']:.1f} s)"
        )
        if window:
            print(
                f"        end of step 1 -> end of last step {window['images_per_s']:.3f} images/s ({window['gap_outside_steps_s']:.1f} s outside steps)"
            )
        print(
            f"  plain steady {p_ss:.3f} images/s (step {plain_steady['steady_step_s_mean']:.2f} s), wall {plain_result['wall_images_per_s']:.3f} images/s ({plain['wall_s']:.1f} s)"
        )
        print(
            f"  flow/plain steady {ratios['steady_images_per_s_flow_over_plain']:.3f}, wall {ratios['wall_images_per_s_flow_over_plain']:.3f}"
        )
        print(
            f"  command -> first step done: flow {tt['command_to_step1_done_s']} s, plain {plain_result['command_to_step1_done_s']} s"
        )
        if rerun_result:
            print(
                f"  rerun on the same PREFECT_HOME ({rerun_result['cached_tasks']} cached tasks): API up "
                f"{rerun_result['command_to_api_up_s']} s, first step done {rerun_result['command_to_step1_done_s']} s"
            )
        print(
            f"  peak memory flow: RSS sum {mb(flow['memory']['peak_rss_sum_mb'])}, PSS sum {mb(flow['memory']['peak_pss_sum_mb'])} "
            f"({flow['memory']['processes_at_peak_pss']} processes); plain: RSS {mb(plain['memory']['peak_rss_sum_mb'])}, PSS {mb(plain['memory']['peak_pss_sum_mb'])}"
        )
        print(
            f"  other processes' CPU share: flow {flow['other_processes_cpu_share']}, plain {plain['other_processes_cpu_share']}"
        )
        print("  phase (mean s, steps 2..N): flow / plain")
        for name, (f, p) in phases.items():
            print(f"    {name}: {f if f is None else round(f, 3)} / {p if p is None else round(p, 3)}")
        print("  targets: " + ", ".join(f"{k} {'met' if t['met'] else 'NOT met'} ({t['value']})" for k, t in targets.items()))
        print(f"  written to {out}")
        return 0
    finally:
        if args.keep_tmp:
            print(f"bench_flow: kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
