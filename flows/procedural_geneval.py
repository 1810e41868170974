"""`procedural_geneval`: learning you can see on a laptop. RL against more supervised training on a procedural
compositional benchmark (GenEval at toy scale), as one pipeline flow with nested subflows.

  1. build_procedural_data   the random pixel-space SD3 model, the seen / held-out prompt files
  2. pretrain_base           supervised flow matching on biased data until the plateau (its own checkpoint, reused)
  3. evaluate base           the verifier on all 120 scenes at fixed seeds
  4. branch A: main_diffusion_v1 (subflow): Flow-GRPO from the base with the `procedural_geneval` reward
  5. branch B: supervised_control: the same wall time of more supervised training from the same base
  6. evaluate rl / control, then the report artifact (accuracy table, grids, reward curve) and result.json

The data carries two designed biases: a share of the "on the left" images drawn in the center, and a share of the
"blue square" images drawn red (a colour swap for one shape). More supervised training learns them; the verifier's reward lets RL unlearn them.
CLI: `omniflow procedural-geneval [--seed N] [key.path=value ...]` (RL overrides); deployment `procedural-geneval`.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

from omniflow.flows.library_use import flow_with_embedded_api
from omniflow.flows.main_diffusion_v1 import main_diffusion_v1
from omniflow.flows.runner import shutdown_ray
from omniflow.tasks.procedural import build_procedural_data, evaluate_procedural, pretrain_base, supervised_control
from omniflow.tasks.publish_reports import publish_card
from omniflow.tasks.validate_config import validate_config
from pydantic import BaseModel, Field

from omni_core.distributed.ray_cluster import connect_ray
from omni_core.recipes.procedural_geneval.data import CaptionBias, DataDesign, LabelNoise
from omni_core.recipes.procedural_geneval.report import guard_drop, headline, report_markdown
from omni_core.recipes.procedural_geneval.stages import reward_curve, rl_config_file, rl_overrides
from omni_core.recipes.procedural_geneval.supervised import SupervisedSettings
from omni_core.reports.cards import Card
from omni_core.reports.plots import save_reward_curve


class ProceduralResult(BaseModel):
    """What `procedural_geneval` returns (also written as `result.json` in its run folder)."""

    seed: int = Field(description="The seed of the data, the model and the runs.")
    run_dir: str = Field(description="This run's folder: RL checkpoints, control model, grids, report, result.json.")
    base_dir: str = Field(description="The supervised base (pipeline folder), reused by runs of the same design.")
    models: dict = Field(description="Per model (base, rl, control): accuracies per bias, attribute, seen / held-out.")
    guard: dict = Field(description="Per model (rl, control): drop below the base on what no bias corrupts.")
    stage_seconds: dict[str, float] = Field(description="Wall seconds of each stage.")
    pretrain: dict = Field(description="Steps, seconds, stop reason and evaluation metric history of the base.")
    rl_run: dict = Field(description="The Flow-GRPO run: steps, seconds, final checkpoint, reward per step.")
    control_run: dict = Field(description="The control: steps, seconds spent, budget.")
    report: str = Field(description="The report (markdown) file.")


def _condition(pairs: list[str]) -> tuple[tuple[str, str], ...]:
    """`["shape=square"]` -> `(("shape", "square"),)`; anything else names the parameter and the form."""
    out = []
    for pair in pairs:
        attribute, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"colour_bias_when: {pair!r} is not attribute=value (e.g. shape=square, background=black)")
        out.append((attribute.strip(), value.strip()))
    return tuple(out)


def design_from(
    seed: int,
    position_bias: float,
    colour_bias: float,
    label_noise: float,
    n_held_out: int,
    renders: int,
    colour_bias_when: list[str] | None = None,
) -> DataDesign:
    biases = []
    if position_bias > 0:
        biases.append(CaptionBias("position", "left", "center", position_bias))
    if colour_bias > 0:
        when = _condition(["shape=square"] if colour_bias_when is None else colour_bias_when)
        biases.append(CaptionBias("colour", "blue", "red", colour_bias, when=when))
    noise = (LabelNoise("position", label_noise),) if label_noise > 0 else ()
    return DataDesign(
        renders_per_combination=renders, n_held_out=n_held_out, split_seed=seed, biases=tuple(biases), label_noise=noise
    )


@flow_with_embedded_api(name="procedural-geneval", log_prints=True, persist_result=True, result_serializer="json")
def procedural_geneval(
    out_dir: str = "outputs/procedural-geneval",
    seed: Annotated[int, Field(ge=0)] = 0,
    position_bias: Annotated[float, Field(ge=0, le=1)] = 0.7,
    colour_bias: Annotated[float, Field(ge=0, le=1)] = 0.7,
    colour_bias_when: list[str] = ["shape=square"],  # noqa: B006
    label_noise: Annotated[float, Field(ge=0, le=1)] = 0.0,
    n_held_out: Annotated[int, Field(ge=0, le=100)] = 24,
    renders_per_combination: Annotated[int, Field(ge=1)] = 100,
    pretrain_max_seconds: Annotated[float, Field(gt=0)] = 600.0,
    pretrain_min_steps: Annotated[int, Field(ge=0)] = 600,
    pretrain_eval_every_steps: Annotated[int, Field(ge=1)] = 150,
    pretrain_patience: Annotated[int, Field(ge=1)] = 2,
    rl_steps: Annotated[int, Field(ge=1)] = 80,
    rl_overrides_extra: list[str] = [],  # noqa: B006  (Prefect parameters are copied per run)
    eval_samples_per_prompt: Annotated[int, Field(ge=1, le=16)] = 2,
) -> ProceduralResult:
    """Pre-train a tiny model on biased procedural scenes, then compare Flow-GRPO with a matched supervised control.

    Args:
        out_dir: Benchmark folder; the base is kept per seed and design, each run gets its own folder under `runs/`.
        seed: Seed of the held-out split, the renders, the model's initial weights and the runs' noise.
        position_bias: Share of the "on the left" training images drawn in the center (0: no such bias).
        colour_bias: Share of the "blue square" training images drawn red (0: no such bias).
        colour_bias_when: Which "blue" images the colour bias applies to, as attribute=value pairs (default
            shape=square; [] for every blue image; background=black for those on black).
        label_noise: Share of the position labels replaced by a random position (uniform noise).
        n_held_out: Combinations (of 120) kept out of all training and evaluated separately.
        renders_per_combination: Jittered training images per seen combination.
        pretrain_max_seconds: Wall-time cap of the pre-training (it stops earlier at its plateau).
        pretrain_min_steps: Steps before the plateau rule may stop the pre-training.
        pretrain_eval_every_steps: Steps between the pre-training's evaluations.
        pretrain_patience: Evaluations without improvement (by 1 point of mean accuracy) that make the plateau.
        rl_steps: Flow-GRPO steps (8 prompts x 8 samples each); the control gets the RL stage's wall time.
        rl_overrides_extra: `key.path=value` overrides of the Flow-GRPO run on top of the recipe's (its `rl.yaml`).
        eval_samples_per_prompt: Samples per scene in each evaluation (all 120 scenes, fixed seeds).
    """
    design = design_from(seed, position_bias, colour_bias, label_noise, n_held_out, renders_per_combination, colour_bias_when)
    settings = SupervisedSettings(
        max_seconds=pretrain_max_seconds,
        min_steps=pretrain_min_steps,
        eval_every_steps=pretrain_eval_every_steps,
        patience=pretrain_patience,
        seed=seed,
    )
    root = Path(out_dir).resolve() / f"seed_{seed}"
    run_dir = root / "runs" / datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=False)
    seconds: dict[str, float] = {}

    clock = time.monotonic()
    data = build_procedural_data(str(root), design, seed)
    seconds["data"] = time.monotonic() - clock
    rl_files = [rl_config_file()]

    def rl_args(model_dir: str) -> list[str]:
        return [*rl_overrides(data, model_dir, run_dir / "rl", rl_steps, seed), *rl_overrides_extra]

    # Bad RL overrides fail here, before any training: the main flow's own checks, against the random model (the
    # base replaces it once trained).
    cfg = validate_config(None, rl_args(data.init_model), rl_files)
    owns_ray = connect_ray(cfg)
    try:
        clock = time.monotonic()
        base = pretrain_base(data, str(root / f"base-{design.fingerprint()}"), design, settings)
        seconds["pretrain"] = time.monotonic() - clock

        evals: dict[str, dict] = {}
        clock = time.monotonic()
        evals["base"] = evaluate_procedural(
            "base", base.model_dir, None, design, str(run_dir / "eval" / "base.png"), eval_samples_per_prompt, seed
        )
        seconds["evaluate_base"] = time.monotonic() - clock

        clock = time.monotonic()
        train = main_diffusion_v1(overrides=rl_args(base.model_dir), config_files=rl_files)
        seconds["rl"] = round(time.monotonic() - clock, 2)  # the control's budget, as reported

        clock = time.monotonic()
        control = supervised_control(base.model_dir, str(run_dir / "control"), design, seconds["rl"], settings)
        seconds["control"] = time.monotonic() - clock

        clock = time.monotonic()
        evals["rl"] = evaluate_procedural(
            "rl", base.model_dir, train.final_checkpoint, design, str(run_dir / "eval" / "rl.png"), eval_samples_per_prompt, seed
        )
        evals["control"] = evaluate_procedural(
            "control", control.model_dir, None, design, str(run_dir / "eval" / "control.png"), eval_samples_per_prompt, seed
        )
        seconds["evaluate_after"] = time.monotonic() - clock
    finally:
        if owns_ray:
            shutdown_ray()

    models = {k: headline(v["summary"]) for k, v in evals.items()}
    curve = reward_curve(train.log_dir)
    curve_png = save_reward_curve(
        [{"training/global_step": i + 1, "critic/rewards/mean": r} for i, r in enumerate(curve)],
        run_dir / "eval" / "rl_reward_curve.png",
        title="Flow-GRPO, procedural_geneval reward",
    )
    result = {
        "seed": seed,
        "run_dir": str(run_dir),
        "base_dir": base.model_dir,
        "models": models,
        "guard": {m: guard_drop(models["base"], models[m]) for m in ("rl", "control")},
        "stage_seconds": {k: round(v, 2) for k, v in seconds.items()},
        "pretrain": base.to_json(),
        "rl_run": {
            "steps": train.global_step,
            "seconds": round(seconds["rl"], 2),
            "checkpoint": train.final_checkpoint,
            "reward_curve": curve,
        },
        "control_run": {
            "steps": control.steps,
            "seconds": control.seconds,
            "last_step_began": control.last_step_began,
            "budget_seconds": round(seconds["rl"], 2),
        },
    }
    markdown = report_markdown(result, {k: v["grid"] for k, v in evals.items()}, str(curve_png))
    report = run_dir / "report.md"
    report.write_text(markdown)
    result["report"] = str(report)
    (run_dir / "result.json").write_text(json.dumps(result, indent=2))
    lead = "; ".join(
        f"{label}: base {100 * models['base']['biases'][label]['all']:.1f}% -> RL {100 * models['rl']['biases'][label]['all']:.1f}%"
        f" vs control {100 * models['control']['biases'][label]['all']:.1f}%"
        for label in models["base"]["biases"]
    )
    publish_card("omniflow-procedural-geneval", Card(markdown=markdown, description=lead or "procedural GenEval"))
    print(f"procedural-geneval: {lead}")
    print(f"procedural-geneval: report {report}; result {run_dir / 'result.json'}")
    return ProceduralResult(**result)


def main(argv: Sequence[str] | None = None) -> int:
    """`omniflow procedural-geneval [--out-dir DIR] [--seed N] [--rl-steps N] [key.path=value ...]`."""
    import argparse

    from omniflow.flows.runner import run_flow_from_cli

    parser = argparse.ArgumentParser(prog="omniflow procedural-geneval", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default="outputs/procedural-geneval")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rl-steps", type=int, default=80)
    parser.add_argument("--pretrain-max-seconds", type=float, default=600.0)
    parser.add_argument("--pretrain-min-steps", type=int, default=600)
    parser.add_argument(
        "--colour-bias-when", default="shape=square", help="comma-separated attribute=value pairs ('' for every blue image)"
    )
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides of the Flow-GRPO run")
    ns = parser.parse_args(argv)
    parameters = {
        "out_dir": ns.out_dir,
        "seed": ns.seed,
        "rl_steps": ns.rl_steps,
        "pretrain_max_seconds": ns.pretrain_max_seconds,
        "pretrain_min_steps": ns.pretrain_min_steps,
        "rl_overrides_extra": ns.overrides,
        "colour_bias_when": [p for p in ns.colour_bias_when.split(",") if p.strip()],
    }
    return run_flow_from_cli("procedural-geneval", "omniflow.flows.procedural_geneval:procedural_geneval", parameters, _report)


def _report(result: ProceduralResult) -> None:
    print(f"procedural-geneval: result {result.run_dir}/result.json, report {result.report}")


if __name__ == "__main__":
    sys.exit(main())
