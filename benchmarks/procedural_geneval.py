#!/usr/bin/env python
"""The procedural GenEval benchmark: does Flow-GRPO fix what more supervised training cannot?

For each seed, the `procedural-geneval` pipeline flow (`omniflow.flows.procedural_geneval`) runs end to end as a
subprocess with its own `PREFECT_HOME` and no `PREFECT_API_URL`, so it starts the embedded Prefect API and a local
Ray cluster as `omniflow procedural-geneval` does: build data -> pre-train the base to its plateau -> evaluate ->
Flow-GRPO through main_diffusion_v1 -> the matched supervised control (the RL stage's wall time) -> evaluate both.
Its `result.json` is read back and summed up here:

- per seed and as means (with min / max): `base_accuracy`, `rl_accuracy`, `control_accuracy`, each with, per designed
  bias, the accuracy of the corrupted attribute on the prompts it corrupts (seen combinations), the other attributes,
  and all attributes together; the same three on held-out combinations (`*_held_out`);
- `guard`: the largest drop below the base, in points, on what no bias corrupts (each attribute, each position);
- `stage_seconds` per stage and `wall_seconds` of the whole flow;
- `target`: per seed, whether RL beats the control by >= 60 points on every bias, the guard is within 3 points and
  held-out all-attribute accuracy is not below the base.

    python benchmarks/procedural_geneval.py --seeds 3 --out benchmarks/results/procedural_geneval.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

REPO = Path(__file__).resolve().parents[1]
MARGIN, GUARD = 0.60, 0.03


def run_seed(seed: int, out_dir: Path, extra: list[str]) -> tuple[dict, float]:
    """One flow run in a subprocess (embedded API, local Ray); its result.json and wall seconds."""
    with tempfile.TemporaryDirectory(prefix="omniflow-bench-prefect-") as home:
        env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
        env["PREFECT_HOME"] = home
        cmd = [sys.executable, "-m", "omniflow.flows.procedural_geneval", "--out-dir", str(out_dir), "--seed", str(seed), *extra]
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        wall = time.monotonic() - start
    if proc.returncode:
        raise SystemExit(f"seed {seed}: the flow failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    line = next(x for x in reversed(proc.stdout.splitlines()) if "result" in x and "result.json" in x)
    result_file = Path(line.split("result ")[-1].split(",")[0].strip())
    return json.loads(result_file.read_text()), wall


def _accuracy(model: dict, where: str) -> dict:
    """The corrupted attribute per bias on its prompts, and each attribute / all of them, on `where` combinations."""
    return {
        "biases": {label: b[where] for label, b in model["biases"].items()},
        "attributes": {a: model[where][a] for a in ("colour", "shape", "position", "all")},
    }


def summarize_seed(result: dict, wall: float) -> dict:
    models = result["models"]
    row = {"seed": result["seed"], "wall_seconds": round(wall, 1), "stage_seconds": result["stage_seconds"]}
    for m in ("base", "rl", "control"):
        row[f"{m}_accuracy"] = _accuracy(models[m], "seen")
        row[f"{m}_accuracy_held_out"] = _accuracy(models[m], "held_out")
    row["guard"] = {m: round(max(result["guard"][m].values()), 4) for m in ("rl", "control")}
    margins = {
        label: models["rl"]["biases"][label]["seen"] - models["control"]["biases"][label]["seen"]
        for label in models["base"]["biases"]
    }
    held_all = {m: models[m]["held_out"]["all"] for m in ("base", "rl")}
    row["target"] = {
        "rl_minus_control": {k: round(v, 4) for k, v in margins.items()},
        "margin_met": all(v >= MARGIN for v in margins.values()),
        "guard_met": row["guard"]["rl"] <= GUARD,
        "held_out_not_worse": held_all["rl"] >= held_all["base"],
    }
    row["pretrain"] = {k: result["pretrain"][k] for k in ("steps", "seconds", "stopped")}
    row["rl_steps"], row["control_steps"] = result["rl_run"]["steps"], result["control_run"]["steps"]
    row["run_dir"] = result["run_dir"]
    return row


def _spread(values: list[float]) -> dict:
    return {"mean": round(mean(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def aggregate(rows: list[dict]) -> dict:
    out: dict = {}
    for key in (
        "base_accuracy",
        "rl_accuracy",
        "control_accuracy",
        "base_accuracy_held_out",
        "rl_accuracy_held_out",
        "control_accuracy_held_out",
    ):
        out[key] = {
            group: {
                name: _spread([r[key][group][name] for r in rows if r[key][group][name] is not None])
                for name in rows[0][key][group]
            }
            for group in ("biases", "attributes")
        }
    out["guard_rl"] = _spread([r["guard"]["rl"] for r in rows])
    out["wall_seconds"] = _spread([r["wall_seconds"] for r in rows])
    out["stage_seconds"] = {k: _spread([r["stage_seconds"][k] for r in rows]) for k in rows[0]["stage_seconds"]}
    out["target_met_every_seed"] = all(
        r["target"]["margin_met"] and r["target"]["guard_met"] and r["target"]["held_out_not_worse"] for r in rows
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/procedural_geneval.json")
    parser.add_argument("--out-dir", default=None, help="benchmark folder (default: a temporary one)")
    parser.add_argument("extra", nargs="*", help="more arguments of `python -m omniflow.flows.procedural_geneval`")
    ns = parser.parse_args()
    out_dir = Path(ns.out_dir or tempfile.mkdtemp(prefix="omniflow-procedural-")).resolve()
    rows: list[dict] = []
    for seed in range(ns.first_seed, ns.first_seed + ns.seeds):
        result, wall = run_seed(seed, out_dir, ns.extra)
        rows.append(summarize_seed(result, wall))
        print(json.dumps({"seed": seed, "target": rows[-1]["target"], "wall_seconds": rows[-1]["wall_seconds"]}), flush=True)
        report = {  # rewritten after every seed: a long benchmark keeps what it finished
            "benchmark": "procedural_geneval",
            "command": " ".join(["python", "benchmarks/procedural_geneval.py", *sys.argv[1:]]),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
            "seeds_done": len(rows),
            "seeds": rows,
            "means": aggregate(rows),
        }
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
