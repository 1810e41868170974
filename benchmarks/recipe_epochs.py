"""verl-omni's public recipes trained for one epoch as written, on tiny models of their architectures.

For each recipe (`tests/data/verl_omni_recipes/<name>.txt`: the key=value arguments of its script in verl-omni's
`examples/`), this script changes only what a user porting the recipe changes:

- the paths: `actor_rollout_ref.model.path` (and the distillation teacher's) at a tiny random-weight model of the
  recipe's architecture built here (`omniflow make-tiny-model --vae-scale-factor 8`: the real models' latent grid, so
  an image is as many tokens as on the real model; an SD3 one with `--max-image-size` of the recipe's side; the
  teacher is the same architecture of another seed);
  `data.train_files` / `data.val_files` at a prompt file of exactly `data.train_batch_size` prompts, so one epoch is
  one step (an offline DPO recipe: a pair file of that many pairs, `omniflow make-dataset --pairs`);
  `reward.custom_reward_function.path` at a local file that defines the recipe's function name (mean brightness: the
  recipe's OCR judge is a served vision-language model, which OmniFlow refuses, `reward.reward_model.*`);
- the keys `omniflow validate` refuses (each with its reason in the JSON: the serving engine's knobs, CPU offload, the
  served reward model, rank counts this machine cannot host), dropped;
- `trainer.total_epochs=1` and `trainer.total_training_steps` unset (one epoch), the console and file loggers, the
  checkpoint folder and, with no Prefect server to hold it, no GPU concurrency slot (`trainer.concurrency.gpu_limit`).

Everything else keeps the recipe's value: batch sizes, `rollout.n`, resolution, sampling steps, LoRA rank, dtypes,
rank counts that fit, the algorithm's keys, validation. Each run is `python -m omniflow.flows.main_diffusion_v1` (the
embedded Prefect API, a local Ray), one after the other. The JSON records per recipe: the refused keys with reasons,
the overrides run, exit code, wall time, the step's metrics (loss, reward, timings) and the checkpoint written.

    python benchmarks/recipe_epochs.py                                   # the three non-policy-gradient recipes
    python benchmarks/recipe_epochs.py --recipes run_qwen_image_online_dpo_lora --out /tmp/dpo.json
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
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "tests" / "data" / "verl_omni_recipes"
DEFAULT_RECIPES = ("run_qwen_image_ocr_lora_diffusionnft", "run_qwen_image_online_dpo_lora", "run_sd35_medium_ocr_distill")
TEACHER = "distillation.teacher_models.teacher_model.model_path"
REWARD = '''"""The recipe's reward function name, scoring mean brightness in [0, 1] (the recipe's OCR judge is a served model)."""
import numpy as np


def {name}(data_source, solution_image, ground_truth=None, extra_info=None):
    return float(np.asarray(solution_image, dtype=np.float32).mean() / 255.0)
'''


def recipe_overrides(name: str) -> list[str]:
    """The recipe's key=value arguments as written."""
    lines = (RECIPES / f"{name}.txt").read_text().splitlines()
    return [line for line in lines if line.strip() and not line.startswith("#")]


def key_of(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def value_of(overrides: list[str], key: str, default: str | None = None) -> str | None:
    for override in overrides:
        if key_of(override) == key:
            return override.split("=", 1)[1]
    return default


def architecture(overrides: list[str]) -> str:
    """The tiny architecture of the recipe's model (its Hub id or path names the family)."""
    path = (value_of(overrides, "actor_rollout_ref.model.path") or "").lower()
    for needle, arch in (("qwen-image", "qwen-image"), ("flux", "flux"), ("stable-diffusion-3", "sd3")):
        if needle in path:
            return arch
    raise SystemExit(f"recipe_epochs: no tiny architecture for model path {path!r}")


def tiny_model(arch: str, seed: int, folder: Path, side: int) -> Path:
    """The tiny model of `arch` with the real models' VAE factor 8 (an image is as many tokens as on the real model);
    an SD3 one with a position table that covers the recipe's image side."""
    if not (folder / "model_index.json").exists():
        cmd = [sys.executable, "-m", "omniflow.flows.cli", "make-tiny-model", str(folder), "--arch", arch, "--seed", str(seed)]
        cmd += ["--vae-scale-factor", "8"] + (["--max-image-size", str(side)] if arch == "sd3" else [])
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
    return folder


def prompt_file(count: int, folder: Path) -> Path:
    """`count` distinct prompts (the packaged training prompts, numbered past their end)."""
    base = (REPO / "omni_core" / "assets" / "prompts" / "train.txt").read_text().split("\n")
    base = [p for p in base if p.strip()]
    prompts = [base[i % len(base)] + ("" if i < len(base) else f", picture {i}") for i in range(count)]
    path = folder / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n")
    return path


def pair_file(count: int, folder: Path) -> Path:
    """`count` preference pairs (a bright chosen and a dark rejected 64 px image each) through `omniflow make-dataset`."""
    from PIL import Image

    pairs = folder / "pairs"
    pairs.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (pairs / f"{i:03d}.txt").write_text(f"picture number {i}\n")
        Image.new("RGB", (64, 64), (200 + i % 50, 180, 150)).save(pairs / f"{i:03d}_win.png")
        Image.new("RGB", (64, 64), (40, 60, 90 + i % 50)).save(pairs / f"{i:03d}_lose.png")
    out = folder / "pairs.parquet"
    cmd = [sys.executable, "-m", "omniflow.flows.cli", "make-dataset", "--pairs", str(pairs), str(out)]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
    return out


def localised(name: str, work: Path) -> list[str]:
    """The recipe with its paths pointed at local files (built here)."""
    overrides = recipe_overrides(name)
    arch = architecture(overrides)
    batch = int(value_of(overrides, "data.train_batch_size", "8") or 8)
    offline = value_of(overrides, "algorithm.sample_source") == "offline"
    from omni_core.config import load_config

    pipeline = load_config(overrides=[o for o in overrides if key_of(o).startswith("actor_rollout_ref.rollout.pipeline.")])
    side = max(pipeline.actor_rollout_ref.rollout.pipeline.height, pipeline.actor_rollout_ref.rollout.pipeline.width)
    data = pair_file(batch, work) if offline else prompt_file(batch, work)
    reward = work / "reward.py"
    reward.write_text(REWARD.format(name=value_of(overrides, "reward.custom_reward_function.name", "compute_score")))
    paths = {
        "actor_rollout_ref.model.path": tiny_model(arch, 0, work / "model", side),
        "data.train_files": data,
        "data.val_files": data,
        "reward.custom_reward_function.path": reward,
        TEACHER: tiny_model(arch, 1, work / "teacher", side),
    }
    return [f"{key_of(o)}={paths[key_of(o)]}" if key_of(o) in paths else o for o in overrides]


def without_refused(overrides: list[str]) -> tuple[list[str], dict[str, str]]:
    """The overrides minus the keys `omniflow validate` refuses (repeated until it accepts), and each refusal."""
    from omni_core.config import ConfigError
    from omni_core.validation import prepare_run_config

    refused: dict[str, str] = {}
    for _ in range(4):
        try:
            prepare_run_config(None, [*overrides, "trainer.logger=[console]"])
            return overrides, refused
        except ConfigError as err:
            new = {p.key: str(p) for p in err.problems if p.key not in refused}
            if not new:
                raise
            refused.update(new)
            overrides = [o for o in overrides if not any(key_of(o) == k or key_of(o).startswith(k + ".") for k in refused)]
    raise SystemExit(f"recipe_epochs: the recipe still fails validation after dropping {sorted(refused)}")


def run_recipe(name: str, work: Path, timeout_s: float) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    overrides, refused = without_refused(localised(name, work))
    ckpt = work / "ckpt"
    extra = [
        "trainer.total_epochs=1",
        "trainer.total_training_steps=null",
        "trainer.logger=[console,file]",
        "trainer.concurrency.gpu_limit=null",
        f"trainer.default_local_dir={ckpt}",
    ]
    overrides = [o for o in overrides if key_of(o) not in {key_of(e) for e in extra}] + extra
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "RAY_ADDRESS")}
    env.update(PREFECT_HOME=str(work / "prefect"), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "omniflow.flows.main_diffusion_v1", *overrides]
    print(f"recipe_epochs: {name}: {len(refused)} refused keys dropped; running one epoch", flush=True)
    t0 = time.monotonic()
    log_path = work / "run.log"
    with log_path.open("w") as log:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    wall = time.monotonic() - t0
    records = [json.loads(line) for f in sorted(ckpt.glob("logs/*/metrics.jsonl")) for line in f.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "timing_s/step" in r]
    print(f"recipe_epochs: {name}: exit {rc} after {wall:.0f} s, {len(steps)} step(s)", flush=True)
    return {
        "recipe": name,
        "returncode": rc,
        "wall_s": round(wall, 1),
        "refused": refused,
        "overrides": overrides,
        "steps": steps,
        "validation": [r for r in records if "timing_s/step" not in r],
        "checkpoints": sorted(str(p.relative_to(ckpt)) for p in ckpt.glob("global_step_*")),
        "log_tail": log_path.read_text().splitlines()[-40:],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=list(DEFAULT_RECIPES), help="recipe names (tests/data/verl_omni_recipes)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "recipe_epochs.json"))
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="limit per recipe")
    parser.add_argument("--work-dir", default=None, help="keep models, logs and checkpoints here (default: a temp folder)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="omniflow-recipe-epochs-"))
    results = [run_recipe(name, work / name, args.timeout_s) for name in args.recipes]
    out = {
        "benchmark": "recipe_epochs",
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "work_dir": str(work),
        "recipes": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"recipe_epochs: wrote {args.out}", flush=True)
    return 0 if all(r["returncode"] == 0 and r["steps"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
