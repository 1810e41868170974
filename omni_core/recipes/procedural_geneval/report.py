"""What the procedural benchmark reports: headline accuracies per model, the guard on the other attributes, and the
markdown of the report artifact (accuracy table, image grids, reward curve)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from omni_core.recipes.procedural_geneval.verifier import ATTRIBUTES
from omni_core.reports.images import markdown_image

__all__ = ["guard_drop", "headline", "report_markdown"]

MODELS = ("base", "rl", "control")


def headline(summary: Mapping) -> dict:
    """One model's figures: per bias, the corrupted attribute's accuracy on the prompts it corrupts (all, seen,
    held-out); each attribute and all attributes together, on all / seen / held-out combinations."""
    out = {
        "biases": {
            label: {k: b[k] for k in ("attribute", "prompts", "samples", "all", "seen", "held_out", "all_attributes")}
            for label, b in summary["biases"].items()
        },
        "attributes": {a: summary["overall"][a]["all"] for a in (*ATTRIBUTES, "all")},
        "seen": {a: summary["overall"][a]["seen"] for a in (*ATTRIBUTES, "all")},
        "held_out": {a: summary["overall"][a]["held_out"] for a in (*ATTRIBUTES, "all")},
        "unbiased": dict(summary["unbiased"]),
        "per_position": dict(summary["per_position"]),
    }
    return out


def guard_drop(base: Mapping, model: Mapping) -> dict[str, float]:
    """How far `model` falls below `base` (positive: worse) on what no bias corrupts: each attribute on the prompts
    no bias corrupts for it, and position accuracy per position value other than the biased ones."""
    drops = {f"attribute:{a}": base["unbiased"][a] - model["unbiased"][a] for a in ATTRIBUTES}
    biased_positions = {b["attribute"] == "position" and label.split(" ")[0] for label, b in base["biases"].items()}
    for position, value in base["per_position"].items():
        if position not in biased_positions and value is not None:
            drops[f"position:{position}"] = value - model["per_position"][position]
    return drops


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def report_markdown(result: Mapping, grids: Mapping[str, str], reward_curve: str | None) -> str:
    """The report artifact: the accuracy table (seen / held-out per bias, per attribute), the guard, the stages'
    wall seconds, the image grids of the same prompts and seeds, and the RL reward curve."""
    heads = {m: result["models"][m] for m in MODELS}
    biases = list(heads["base"]["biases"])
    lines = [f"# Procedural GenEval, seed {result['seed']}", ""]
    cols = [f"{b} ({heads['base']['biases'][b]['attribute']}): seen / held-out" for b in biases]
    cols += [f"{a} (all)" for a in ATTRIBUTES] + ["all attributes: seen / held-out"]
    lines += ["| model | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for m in MODELS:
        h = heads[m]
        cells = [f"{_pct(h['biases'][b]['seen'])} / {_pct(h['biases'][b]['held_out'])}" for b in biases]
        cells += [_pct(h["attributes"][a]) for a in ATTRIBUTES]
        cells += [f"{_pct(h['seen']['all'])} / {_pct(h['held_out']['all'])}"]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "Largest drop below the base on what no bias corrupts (attributes, positions):"]
    for m in ("rl", "control"):
        worst = max(result["guard"][m].items(), key=lambda kv: kv[1])
        lines.append(f"- {m}: {100 * worst[1]:+.1f} points ({worst[0]})")
    seconds = ", ".join(f"{k} {v:.0f} s" for k, v in result["stage_seconds"].items())
    lines += ["", f"Wall time per stage: {seconds}.", ""]
    control = result["control_run"]
    lines.append(
        f"Control: {control['steps']} supervised steps in {control['seconds']:.0f} s (budget {control['budget_seconds']:.0f} s"
        " = the RL stage's wall time). RL: "
        f"{result['rl_run']['steps']} Flow-GRPO steps in {result['rl_run']['seconds']:.0f} s."
    )
    for m in MODELS:
        if m in grids:
            lines += ["", f"## {m}: same prompts and seeds (rows: prompts)", "", markdown_image(Path(grids[m]), f"{m} grid")]
    if reward_curve:
        lines += ["", "## RL reward curve", "", markdown_image(Path(reward_curve), "reward curve")]
    return "\n".join(lines) + "\n"
