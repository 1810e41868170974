"""The procedural benchmark's tasks (`flows/procedural_geneval.py`): build its data, pre-train the base to its
plateau, run the supervised control, evaluate a model. The heavy ones run as Ray tasks (`omni_core.recipes.procedural_geneval.stages`)
on the cluster the flow connected; each prints one line a newcomer can follow."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from omni_core.recipes.procedural_geneval.data import DataDesign
from omni_core.recipes.procedural_geneval.stages import (
    ProceduralData,
    control_on_ray,
    evaluate_on_ray,
    prepare_data,
    pretrain_on_ray,
)
from omni_core.recipes.procedural_geneval.supervised import SupervisedResult, SupervisedSettings

RAY_OPTIONS = {"num_cpus": 1}


@task(name="build_procedural_data", cache_policy=NO_CACHE)
def build_procedural_data(root: str, design: DataDesign, model_seed: int) -> ProceduralData:
    """The random-weight model and the seen / held-out prompt files."""
    data = prepare_data(root, design, model_seed)
    print(f"data: {data.n_seen} seen / {data.n_held_out} held-out combinations; random model {data.init_model}")
    return data


# A retry resumes from the last evaluation's checkpoint (`<base>.partial/state.pt`).
@task(name="pretrain_base", cache_policy=NO_CACHE, retries=1)
def pretrain_base(data: ProceduralData, base_dir: str, design: DataDesign, settings: SupervisedSettings) -> SupervisedResult:
    """Supervised flow matching of the random model on the design's data until its plateau."""
    result = pretrain_on_ray(data.init_model, base_dir, design, settings, **RAY_OPTIONS)
    last = result.history[-1]["metric"] if result.history else float("nan")
    print(f"pretrain: {result.steps} steps in {result.seconds:.0f} s, stopped at {result.stopped} (mean accuracy {last:.3f})")
    return result


@task(name="supervised_control", cache_policy=NO_CACHE)
def supervised_control(
    base_dir: str, out_dir: str, design: DataDesign, budget_seconds: float, settings: SupervisedSettings
) -> SupervisedResult:
    """The matched control: more supervised training from the base for the RL stage's wall time."""
    result = control_on_ray(base_dir, out_dir, design, budget_seconds, settings, **RAY_OPTIONS)
    print(f"control: {result.steps} supervised steps in {result.seconds:.0f} s (budget {budget_seconds:.0f} s)")
    return result


@task(name="evaluate_procedural", cache_policy=NO_CACHE, task_run_name="evaluate_procedural-{label}")
def evaluate_procedural(
    label: str, model_dir: str, checkpoint: str | None, design: DataDesign, grid_path: str, samples_per_prompt: int, seed: int
) -> dict:
    """Verifier accuracies of one model on all scenes at fixed seeds, and its image grid."""
    result = evaluate_on_ray(model_dir, checkpoint, design, grid_path, samples_per_prompt, seed, **RAY_OPTIONS)
    overall = result["summary"]["overall"]
    biases = ", ".join(f"{k} {100 * (v['all'] or 0):.1f}%" for k, v in result["summary"]["biases"].items())
    print(
        f"evaluate {label}: colour {100 * overall['colour']['all']:.1f}%, position {100 * overall['position']['all']:.1f}%, "
        f"shape {100 * overall['shape']['all']:.1f}%; biased prompts: {biases}"
    )
    return result
