#!/usr/bin/env python
"""What a little background CPU costs a training step that owns every core: the plain loop alone and next to a
synthetic background load, alternating, in one invocation.

Why: in a running flow the rollout and the update run in the training actor (the hybrid engine) on every core,
and the rest of the run keeps waking up: the Prefect server's services, the `fit_epoch` controller, the flow
process, TransferQueue's idle actors (Ray wakes every idle actor every 10 ms) and Ray's daemons. `bench_flow.py`
reports their share of the machine (`other_processes_cpu_share`) and the flow's steady step against the plain
loop's. This benchmark asks whether that share explains the gap: each wake-up preempts one of the step's torch
threads, and the other waits for it at the next barrier, so the step loses more than the background uses.

The background is two subprocesses: `ticks` (`--tick-hz` wake-ups a second, `--tick-us` of work each) and `bursts`
(`--burst-hz` x `--burst-us`). Their CPU time is measured while the loop runs and reported as a share of the
machine, next to the plain loop's median step with and without them.

    python benchmarks/bench_background.py [--steps 8] [--rounds 2] [--out benchmarks/results/background.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_flow import _git_rev, _machine, _versions, wait_for_quiet  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WAKER = """
import sys, time
period, work = 1.0 / float(sys.argv[1]), float(sys.argv[2]) / 1e6
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < work:
        pass
    time.sleep(period)
"""


def plain_loop(model: str, steps: int, overrides: list[str]) -> dict[str, Any]:
    """`benchmarks/plain_loop.py` for `steps` steps: medians of steps 2..N (step 1 carries warm-up)."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "plain_loop.py"), f"actor_rollout_ref.model.path={model}", *overrides]
    out = subprocess.run([*cmd, "--steps", str(steps)], capture_output=True, text=True, cwd=REPO, check=True)
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"step"')][1:]
    return {
        "step_s_median": statistics.median(r["step_s"] for r in records),
        "gen_s_median": statistics.median(r["gen_s"] for r in records),
        "update_s_median": statistics.median(r["update_s"] for r in records),
        "steps": len(records),
    }


def with_background(args: argparse.Namespace) -> tuple[dict[str, Any], float]:
    """The plain loop next to the two waker processes; (its result, the wakers' share of the machine's CPU)."""
    loads = [(args.tick_hz, args.tick_us), (args.burst_hz, args.burst_us)]
    wakers = [subprocess.Popen([sys.executable, "-c", WAKER, str(hz), str(us)]) for hz, us in loads]
    procs = [psutil.Process(w.pid) for w in wakers]
    try:
        start, cpu0 = time.monotonic(), sum(sum(p.cpu_times()[:2]) for p in procs)
        result = plain_loop(args.model, args.steps, args.overrides)
        cpu = sum(sum(p.cpu_times()[:2]) for p in procs) - cpu0
        share = cpu / ((time.monotonic() - start) * (psutil.cpu_count() or 1))
    finally:
        for w in wakers:
            w.kill()
            w.wait()
    return result, share


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides of the plain loop")
    parser.add_argument("--model", default=str(REPO / "models" / "tiny-sd3"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="alone / with background pairs, alternating")
    parser.add_argument("--tick-hz", type=float, default=300.0)
    parser.add_argument("--tick-us", type=float, default=30.0)
    parser.add_argument("--burst-hz", type=float, default=50.0)
    parser.add_argument("--burst-us", type=float, default=3000.0)
    parser.add_argument("--max-load", type=float, default=1.5)
    parser.add_argument("--max-wait-s", type=float, default=300.0)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "background.json"))
    args = parser.parse_args(argv)
    if not (Path(args.model) / "model_index.json").is_file():
        parser.error(f"no tiny model at {args.model}: build it with `omniflow make-tiny-model {args.model}`")

    quiet = wait_for_quiet(args.max_load, args.max_wait_s, 15.0)
    rounds = []
    for i in range(args.rounds):
        alone = plain_loop(args.model, args.steps, args.overrides)
        busy, share = with_background(args)
        rounds.append({"alone": alone, "background": busy, "background_cpu_share": share})
        print(
            f"bench_background: round {i + 1}: step {alone['step_s_median']:.3f} s alone, {busy['step_s_median']:.3f} s "
            f"next to {share:.3f} of the CPU",
            flush=True,
        )
    alone_s = statistics.median(r["alone"]["step_s_median"] for r in rounds)
    busy_s = statistics.median(r["background"]["step_s_median"] for r in rounds)
    share = statistics.mean(r["background_cpu_share"] for r in rounds)
    result = {
        "benchmark": "omniflow.background_cost",
        "schema_version": 1,
        "command": " ".join(["python", "benchmarks/bench_background.py", *(argv if argv is not None else sys.argv[1:])]),
        "timestamp_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git": _git_rev(),
        "versions": _versions(),
        "machine": {**_machine(), **quiet},
        "background": {"tick_hz": args.tick_hz, "tick_us": args.tick_us, "burst_hz": args.burst_hz, "burst_us": args.burst_us},
        "rounds": rounds,
        "summary": {
            "step_s_alone": alone_s,
            "step_s_with_background": busy_s,
            "background_cpu_share_of_machine": share,
            "speed_with_background_over_alone": alone_s / busy_s,
            "step_time_lost_over_cpu_share": (busy_s / alone_s - 1.0) / share if share > 0 else None,
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))
    print(f"  written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
