"""The model card (`README.md`) of an export: what a person who downloads the folder needs to know about it.

Diffusers-style: YAML front matter (`library_name: diffusers`, `base_model`, tags, written with huggingface_hub's
`ModelCardData`, so the Hub and `ModelCard.load` read it), then the algorithm, the reward(s), the steps trained,
the final metrics and the training config. Everything comes from what the checkpoint really holds:

- `config.yaml`: the resolved run config (algorithm, rewards, LoRA, experiment name), shown whole at the end;
- `controller.json`: the run that wrote the checkpoint (`run_id`);
- `<root>/logs/<run id>/metrics.jsonl` (the `file` logger): the records at the checkpoint's step, merged (a step
  logs its training metrics and, when it validates, its `val-core/*` metrics).

A card never fails an export: what the checkpoint lacks (a bare `actor.save` folder, a run without the `file`
logger) is said in the card instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from omni_core.checkpoint.layout import CONFIG_FILE, run_log_dir
from omni_core.checkpoint.writer import CONTROLLER_STATE

CARD_FILE = "README.md"
METRICS_FILE = "metrics.jsonl"  # what `Tracking`'s file backend writes in a run's log folder


def read_run_config(checkpoint: Path) -> dict[str, Any] | None:
    """The checkpoint's `config.yaml` as plain data (no validation: a card describes, it does not judge), or None."""
    path = checkpoint / CONFIG_FILE
    if not path.is_file():
        return None
    data = yaml.safe_load(path.read_text())
    return data if isinstance(data, dict) else None


def config_value(config: Mapping[str, Any] | None, key: str, default: Any = None) -> Any:
    """`config["a"]["b"]` for `key="a.b"`, or `default` where a part is missing."""
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def checkpoint_metrics(checkpoint: Path, step: int | None) -> tuple[dict[str, float], Path | None]:
    """The metrics the run logged at `step` (its records of that step merged) and the file they came from.

    The run is the one that wrote the checkpoint (`controller.json`'s `run_id`); its log folder sits in the checkpoint
    folder's root. Empty (and the path looked at, or None) when that run kept no `file` log.
    """
    try:
        run_id = json.loads((checkpoint / f"{CONTROLLER_STATE}.json").read_text()).get("run_id")
    except (OSError, ValueError):
        run_id = None
    if not run_id or step is None:
        return {}, None
    path = run_log_dir(checkpoint.parent, run_id) / METRICS_FILE
    merged: dict[str, float] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            record = json.loads(line) if line.strip() else {}
            if record.get("step") == step:
                merged.update({k: v for k, v in record.items() if k != "step"})
    return merged, path


def reward_names(config: Mapping[str, Any] | None) -> list[str]:
    """The reward(s) a run trained on, as its config names them (weights shown when several combine)."""
    entries = config_value(config, "reward.reward_functions") or []
    if isinstance(entries, Mapping):  # verl-omni's {label: {path, name, weight}}
        entries = [{"label": k, **v} for k, v in entries.items()]
    names = []
    for entry in entries:
        name = entry.get("label") or entry.get("name") or entry.get("server_url") or entry.get("path") or "reward"
        if entry.get("path") and entry.get("function"):
            name = f"{entry['path']}:{entry['function']}"
        names.append(f"{name} (weight {entry['weight']})" if "weight" in entry and len(entries) > 1 else str(name))
    if names:
        return names
    custom = config_value(config, "reward.custom_reward_function.path")
    if custom:
        return [f"{custom}:{config_value(config, 'reward.custom_reward_function.name', 'compute_score')}"]
    return ["the built-in reward named by each prompt's data_source (default jpeg_compressibility)"]


def model_card(
    base_model: str,
    checkpoint: Path,
    step: int | None,
    kind: str,
    out_dir: Path,
    details: Mapping[str, str] | None = None,
) -> str:
    """The card's text for an export of `checkpoint` (step `step`) on `base_model`; `kind` `"full"` or `"lora"`;
    `details`: more rows for the export table (e.g. the format and which weights)."""
    from huggingface_hub import ModelCardData

    config = read_run_config(checkpoint)
    algorithm = config_value(config, "actor_rollout_ref.model.algorithm", "flow_grpo")
    lora_rank = config_value(config, "actor_rollout_ref.model.lora_rank", 0) or 0
    tags = ["omniflow", algorithm.replace("_", "-"), "text-to-image", "diffusers", "reinforcement-learning"]
    if kind == "lora":
        tags.append("lora")
    data = ModelCardData(library_name="diffusers", base_model=base_model, pipeline_tag="text-to-image", tags=tags)
    metrics, metrics_file = checkpoint_metrics(checkpoint, step)
    name = config_value(config, "trainer.experiment_name") or checkpoint.parent.name

    rows = {
        "algorithm": f"{algorithm} (loss {config_value(config, 'actor_rollout_ref.actor.diffusion_loss.loss_mode', '?')}, "
        f"advantages {config_value(config, 'algorithm.adv_estimator', '?')})",
        "reward(s)": "; ".join(reward_names(config)),
        "steps trained": str(step) if step is not None else "unknown",
        "fine-tuning": f"LoRA rank {lora_rank}, alpha {config_value(config, 'actor_rollout_ref.model.lora_alpha')}"
        if lora_rank
        else "full (the whole transformer)",
        "export": "the whole pipeline" if kind == "full" else "the LoRA adapter only",
        **(details or {}),
        "checkpoint": f"`{checkpoint}`",
        "base model": f"`{base_model}`",
    }
    lines = [
        f"# {name}",
        "",
        f"`{base_model}` fine-tuned with reinforcement learning ({algorithm}) by OmniFlow, for {rows['steps trained']} steps.",
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in rows.items()),
        "",
        f"## Final metrics (step {step})",
        "",
    ]
    if metrics:
        lines += ["| metric | value |", "|---|---|", *(f"| {k} | {v!r} |" for k, v in sorted(metrics.items())), ""]
        lines += [f"From `{metrics_file}`.", ""]
    else:
        where = f"`{metrics_file}` holds no record of step {step}" if metrics_file else "the checkpoint names no run"
        lines += [f"None recorded: {where} (add `file` to `trainer.logger` to keep them).", ""]
    lines += ["## Use", "", "```python", "from diffusers import DiffusionPipeline", ""]
    if kind == "full":
        lines += [f'pipe = DiffusionPipeline.from_pretrained("{out_dir}")']
    else:
        lines += [f'pipe = DiffusionPipeline.from_pretrained("{base_model}")', f'pipe.load_lora_weights("{out_dir}")']
    lines += ["```", "", "## Training config", ""]
    if config is not None:
        lines += ["```yaml", (checkpoint / CONFIG_FILE).read_text().rstrip("\n"), "```", ""]
    else:
        lines += [f"None: the checkpoint holds no `{CONFIG_FILE}`.", ""]
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)
