"""`omniflow validate`: wall time and peak RSS of the command, per config, in a fresh process each time.

    python benchmarks/bench_validate.py                      # 7 runs per config -> benchmarks/results/validate.json
    python benchmarks/bench_validate.py --repeats 3 --out /tmp/v.json

Run it from any folder but the repository root when comparing with other code through PYTHONPATH
(`python -m` puts the current folder first on the path).

Each run is `python -m omniflow.flows.cli validate <overrides>` as a subprocess (the installed
`omniflow` script is the same entry point); its wall time is measured around the process, its peak
RSS is the child's own `ru_maxrss` from `os.wait4`. Configs: the defaults, separate_async (which
reached diffusers through the trainer modes before issue 9), LoRA + all loggers + a reward list, and a
config with errors (the path that prints a report and exits 2). The median of the runs is reported
with every run kept. Target (issue 9): under 1.5 s and under 150 MB for every config, on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("results") / "validate.json"
TARGET_WALL_S, TARGET_RSS_MB = 1.5, 150.0

CONFIGS: dict[str, list[str]] = {
    "default": [],
    "separate_async": ["trainer.v1.trainer_mode=separate_async"],
    "lora_loggers_rewards": [
        "actor_rollout_ref.model.lora_rank=8",
        "trainer.logger=[console,file,tensorboard]",
        "reward.reward_functions=[jpeg_compressibility,jpeg_incompressibility]",
    ],
    "with_errors": ["data.train_batch_size=7", "actor_rollout_ref.actor.ppo_mini_batch_size=2"],
}


def run_once(overrides: list[str]) -> dict[str, float]:
    """One `omniflow validate` in a fresh interpreter: wall seconds, peak RSS (MB), exit code."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "omniflow.flows.cli", "validate", *overrides],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024.0, "exit_code": proc.returncode}


def tiny_model_dir() -> str:
    """A folder that passes the model check (validation reads only model_index.json)."""
    d = Path(tempfile.mkdtemp(prefix="omniflow-bench-validate-"))
    (d / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline"}')
    return str(d)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    model = tiny_model_dir()
    load_before = os.getloadavg()
    results = {}
    for name, overrides in CONFIGS.items():
        argv = [f"actor_rollout_ref.model.path={model}", *overrides]
        run_once(argv)  # warm-up: the page cache, not the interpreter
        runs = [run_once(argv) for _ in range(args.repeats)]
        wall = statistics.median(r["wall_s"] for r in runs)
        rss = statistics.median(r["peak_rss_mb"] for r in runs)
        results[name] = {
            "overrides": overrides,
            "exit_code": runs[0]["exit_code"],
            "median_wall_s": round(wall, 3),
            "median_peak_rss_mb": round(rss, 1),
            "max_wall_s": round(max(r["wall_s"] for r in runs), 3),
            "runs": runs,
            "meets_target": wall < TARGET_WALL_S and rss < TARGET_RSS_MB,
        }
        print(f"{name:22s} exit {runs[0]['exit_code']}  wall {wall:.2f} s  peak RSS {rss:.0f} MB")
    out = {
        "benchmark": "omniflow validate (fresh process per run)",
        "command": f"{sys.executable} -m omniflow.flows.cli validate actor_rollout_ref.model.path=<dir> <overrides>",
        "repeats": args.repeats,
        "target": {"wall_s": TARGET_WALL_S, "peak_rss_mb": TARGET_RSS_MB},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        # the code measured: where `omni_core` resolves for the child processes (PYTHONPATH may point elsewhere)
        "omni_core": subprocess.check_output(
            [sys.executable, "-c", "import omni_core; print(omni_core.__file__)"], text=True
        ).strip(),
        "cwd": os.getcwd(),
        "load_avg_before": load_before,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
