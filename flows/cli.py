"""The `omniflow` command: config tools, validation, and (lazily imported) the heavy entry points.

Every subcommand imports what it needs when it runs, so `omniflow validate` answers in about a
second (it imports neither Ray, Prefect, diffusers nor transformers, and torch only on a machine
with an accelerator driver) and never starts Ray, TransferQueue or a Prefect server.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from omniflow.flows.runner import QUIET_ENV, split_files_and_overrides


def _config_args(ns: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(YAML files, overrides) of a command that reads a config: `--config-path/--config-name` name the first file."""
    return split_files_and_overrides(ns.args, ns.config_path, ns.config_name)


def _hydra_options(ns: argparse.Namespace) -> list[str]:
    """`--config-path` / `--config-name` as words again, for a command that takes verl-style argv."""
    return [f"--{name.replace('_', '-')}={value}" for name in ("config_path", "config_name") if (value := getattr(ns, name))]


def _cmd_config_show(ns: argparse.Namespace) -> int:
    from omni_core.config import load_config, to_yaml

    print(to_yaml(load_config(*_config_args(ns))), end="")
    return 0


def _cmd_config_schema(ns: argparse.Namespace) -> int:
    from omni_core.config import OmniFlowConfig

    print(json.dumps(OmniFlowConfig.model_json_schema(), indent=2))
    return 0


def _cmd_validate(ns: argparse.Namespace) -> int:
    from omni_core.validation import prepare_run_config

    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # train's default: a Hub id must be in the cache already
        os.environ.setdefault(key, QUIET_ENV[key])
    files, overrides = _config_args(ns)
    config = prepare_run_config(None, overrides, files)  # exactly what `omniflow train` checks first
    t = config.trainer
    print(
        f"config OK: trainer.v1.trainer_mode={t.v1.trainer_mode} trainer.device={t.device} "
        f"model={config.actor_rollout_ref.model.path} checkpoints={t.checkpoint_dir}"
    )
    return 0


def _cmd_reward_server(ns: argparse.Namespace) -> int:
    from omniflow.flows.reward_server import run_reward_server

    return run_reward_server(ns.args, host=ns.host, port=ns.port)


def _cmd_make_tiny_model(ns: argparse.Namespace) -> int:
    from omni_core.models.hub import shadowed_hub_model

    shadowed = shadowed_hub_model(ns.dir)
    if shadowed:
        print(f"omniflow make-tiny-model: refused: {shadowed}", file=sys.stderr)
        return 2
    if ns.arch == "clip":  # a reward model: CLIP + processor + aesthetic head
        from omni_core.rewards.tiny_clip import AESTHETIC_HEAD_FILE, build_tiny_clip

        path = build_tiny_clip(ns.dir, seed=ns.seed)
        print(f"tiny CLIP reward model written to {path} (aesthetic head: {path / AESTHETIC_HEAD_FILE})")
        return 0
    from omni_core.models.tiny import build_tiny_pipeline

    try:
        path = build_tiny_pipeline(ns.dir, arch=ns.arch, seed=ns.seed, max_image_size=ns.max_image_size, vae_scale_factor=ns.vae_scale_factor)
    except ValueError as err:
        print(f"omniflow make-tiny-model: {err}", file=sys.stderr)
        return 2
    print(f"tiny {ns.arch} pipeline written to {path}")
    return 0


def _cmd_make_dataset(ns: argparse.Namespace) -> int:
    if ns.pairs:  # a folder of image pairs -> verl-omni's offline DPO layout
        from omni_core.data.preference_pairs import make_pair_dataset

        path = make_pair_dataset(ns.source, ns.out, data_source=ns.data_source or "offline_dpo")
        print(f"preference pairs written to {path} (train on it with algorithm.sample_source=offline)")
        return 0
    from omni_core.data.make_dataset import make_dataset

    path = make_dataset(ns.source, ns.out, data_source=ns.data_source or "jpeg_compressibility")
    print(f"verl parquet written to {path}")
    return 0


def _cmd_train(ns: argparse.Namespace) -> int:
    from omniflow.flows.train_cli import run_training

    return run_training([*_hydra_options(ns), *ns.args])


def _cmd_ray_job(ns: argparse.Namespace) -> int:
    """The `ray_job` flow with the same runner as `omniflow train` (embedded Prefect API unless PREFECT_API_URL is set,
    SIGTERM as Ctrl-C: the job is stopped, exit 130)."""
    from omniflow.flows.runner import run_flow_from_cli

    from omni_core.config import load_config
    from omni_core.distributed.ray_job import train_entrypoint

    files, overrides = split_files_and_overrides(ns.args)
    if not ns.address:
        print("omniflow ray-job: give --address http://<head>:8265 (or set RAY_API_SERVER_ADDRESS)", file=sys.stderr)
        return 2
    try:
        runtime_env = json.loads(ns.runtime_env) if ns.runtime_env else None
        train_entrypoint(overrides, files)  # an address override is refused
        load_config(overrides=overrides)  # keys and types; the files and paths are the cluster's, checked by the job
    except (ValueError, json.JSONDecodeError) as exc:  # ConfigError is a ValueError
        print(f"omniflow ray-job: {exc}", file=sys.stderr)
        return 2
    parameters = {
        "address": ns.address,
        "overrides": overrides,
        "config_files": files,
        "runtime_env": runtime_env,
        "entrypoint": ns.entrypoint,
    }

    def report(result) -> None:
        print(f"omniflow ray-job: Ray job {result.job_id} {result.status}: {result.entrypoint}", flush=True)

    return run_flow_from_cli("omniflow ray-job", "omniflow.flows.ray_job:ray_job", parameters, report)


def _cmd_serve(ns: argparse.Namespace) -> int:
    from omniflow.deployments.serve import main as serve_main

    return serve_main(ns.args)


def _cmd_deploy(ns: argparse.Namespace) -> int:
    from omniflow.deployments.deploy import main as deploy_main

    return deploy_main(ns.args)


def _cmd_alerts(ns: argparse.Namespace) -> int:
    """Create or update the `omniflow-alerts` block and the automations on the Prefect API (PREFECT_API_URL, else
    the embedded one of `omniflow serve` / `train`, started for the call)."""
    from omniflow.flows.embedded_api import embedded_prefect_api

    with embedded_prefect_api() as api:
        api.wait_ready()
        from omniflow.deployments.automations import BLOCK_NAME, WEBHOOK_ENV, ensure_automations

        names = ensure_automations(ns.webhook)
    if not names:
        print(
            f"omniflow: no block named {BLOCK_NAME!r} and no URL: give --webhook URL (or {WEBHOOK_ENV}), or save a "
            f"notification block named {BLOCK_NAME!r} in the Prefect UI",
            file=sys.stderr,
        )
        return 2
    where = f"the local Prefect API of PREFECT_HOME={api.server.home} (omniflow serve uses it)" if api.server else api.url
    print(f"automations {', '.join(names)} notify the block {BLOCK_NAME!r}; saved on {where}")
    return 0


def _cmd_export(ns: argparse.Namespace) -> int:
    from omni_core.checkpoint.export import export_trained_checkpoint
    from omni_core.checkpoint.trained import RefusedError

    try:
        info = export_trained_checkpoint(ns.checkpoint, ns.out, format=ns.format, ema=ns.ema, base_model=ns.base_model)
    except RefusedError as exc:
        print(f"omniflow export: {exc}", file=sys.stderr)
        return 2
    weights = "the EMA weights (the run kept an EMA)" if info.weights == "ema" else "the trained weights"
    load = (
        f"pipe = DiffusionPipeline.from_pretrained({info.base_model!r}); pipe.load_lora_weights({info.out_dir!r})"
        if info.kind == "lora"
        else f"DiffusionPipeline.from_pretrained({info.out_dir!r})"
    )
    print(f"exported {info.checkpoint} (step {info.step}) as {info.format}, {weights}, to {info.out_dir}; load: {load}")
    if info.kind == "full":
        print(f"  {info.linked_files} base-model file(s) hard-linked, {info.copied_files} copied (another file system)")
    print(f"  model card: {info.out_dir}/README.md")
    if info.registered_model:
        print(f"  registered in mlflow's model registry as {info.registered_model}")
    return 0


def _add_evaluate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a global_step_N checkpoint folder, or an experiment folder (its newest)")
    parser.add_argument("args", nargs="*", help="key.path=value overrides of the config saved with the checkpoint")
    parser.add_argument("--prompts", help="prompt file (.txt one per line, .jsonl, .parquet); default: the validation prompts")
    parser.add_argument("--seed", type=int, help="base seed of the noise, shared by both (default rollout.val_kwargs.seed)")
    parser.add_argument("--samples", type=int, help="samples per prompt (default rollout.val_kwargs.n)")
    parser.add_argument("--out", help="new or empty report folder (default: evaluate-global_step_N next to the checkpoint)")


def _evaluate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omniflow evaluate", description="The base model against a checkpoint: same prompts, same seeds, the run's reward."
    )
    _add_evaluate_arguments(parser)
    return parser


def _cmd_evaluate(ns: argparse.Namespace) -> int:
    from omni_core.checkpoint.trained import RefusedError
    from omni_core.config import ConfigError
    from omni_core.evaluation import evaluate_trained_checkpoint

    files, overrides = split_files_and_overrides(ns.args)
    try:
        if files:
            raise RefusedError(
                f"{files[0]}: after CHECKPOINT only key.path=value overrides are taken (the config is the one saved with it)"
            )
        result = evaluate_trained_checkpoint(ns.checkpoint, overrides, ns.prompts, ns.seed, ns.samples, ns.out)
    except (RefusedError, ConfigError) as exc:
        print(f"omniflow evaluate: {exc}", file=sys.stderr)
        return 2
    weights = "EMA weights" if result.weights == "ema" else "trained weights"
    before, after = result.before.mean_reward, result.after.mean_reward
    print(
        f"evaluated {result.checkpoint} (step {result.step}, {weights}) against its base model: mean reward {before:.6f} -> "
        f"{after:.6f} ({after - before:+.6f}), {len(result.before.prompts)} prompts x {result.samples_per_prompt} samples, "
        f"seed {result.seed}; report {result.out_dir}"
    )
    return 0


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """A config as verl-omni's entry points take it: Hydra's --config-path/--config-name, YAML files, overrides."""
    parser.add_argument("--config-path", "-cp", help="folder of --config-name (default: the current folder)")
    parser.add_argument("--config-name", "-cn", help="the config to load first: DIR/NAME.yaml (its defaults: list too)")
    parser.add_argument(
        "args", nargs="*", help="YAML files, then overrides: key.path=value, +key.path=value (add), ~key.path (delete)"
    )


def build_parser() -> argparse.ArgumentParser:
    from omni_core.models.architectures import ARCHITECTURES  # light: names only

    parser = argparse.ArgumentParser(
        prog="omniflow",
        description="OmniFlow: Flow-GRPO fine-tuning of diffusion models as a Prefect flow on Ray.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    config = sub.add_parser("config", help="show the resolved config or its JSON schema")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved YAML: omniflow config show [FILE ...] [key=value ...]")
    _add_config_arguments(show)
    show.set_defaults(func=_cmd_config_show)
    schema = config_sub.add_parser("schema", help="print the config's JSON schema")
    schema.set_defaults(func=_cmd_config_schema)

    validate = sub.add_parser("validate", help="check a config (types, cross-field rules, devices) without running")
    _add_config_arguments(validate)
    validate.set_defaults(func=_cmd_validate)

    train = sub.add_parser("train", help="run main_diffusion_v1: omniflow train [FILE ...] [key=value ...]")
    _add_config_arguments(train)
    train.set_defaults(func=_cmd_train)

    ray_job = sub.add_parser(
        "ray-job",
        help="run main_diffusion_v1 as a job on an existing Ray cluster, its logs here: "
        "omniflow ray-job --address http://HEAD:8265 [FILE ...] [key=value ...]",
    )
    ray_job.add_argument(
        "--address",
        default=os.environ.get("RAY_API_SERVER_ADDRESS"),
        help="the cluster's Ray dashboard (job API), e.g. http://head:8265 (default: $RAY_API_SERVER_ADDRESS)",
    )
    ray_job.add_argument(
        "--runtime-env", help='the job\'s Ray runtime_env as JSON, e.g. \'{"env_vars": {"HF_HOME": "/mnt/shared/hf"}}\''
    )
    ray_job.add_argument("--entrypoint", help="another shell command to run as the job instead of omniflow train")
    ray_job.add_argument("args", nargs="*", help="YAML files on the cluster, then key.path=value overrides")
    ray_job.set_defaults(func=_cmd_ray_job)

    serve = sub.add_parser(
        "serve", help="serve the deployments of deployments/definitions.py (schedules, UI-triggered runs) from this process"
    )
    serve.add_argument("args", nargs=argparse.REMAINDER, help="[NAME ...] [--limit N] [--allow-reward-dir DIR]")
    serve.set_defaults(func=_cmd_serve)

    deploy = sub.add_parser(
        "deploy", help="register the deployments of deployments/definitions.py on work pools (then: prefect worker start)"
    )
    deploy.add_argument("args", nargs=argparse.REMAINDER, help="[NAME ...] [--pool POOL] [--docker-image IMAGE]")
    deploy.set_defaults(func=_cmd_deploy)

    alerts = sub.add_parser(
        "alerts", help="notify a webhook (or a notification block) when a run fails or its validation reward regresses"
    )
    alerts.add_argument("--webhook", help="URL to POST JSON alerts to (saved as the Webhook block 'omniflow-alerts')")
    alerts.set_defaults(func=_cmd_alerts)

    reward_server = sub.add_parser(
        "reward-server",
        help="serve the reward terms of a reward config over HTTP (POST /score, GET /health): "
        "omniflow reward-server [--host H] [--port N] [FILE ...] [reward.key=value ...]",
    )
    reward_server.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    reward_server.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 picks a free one)")
    reward_server.add_argument(
        "args", nargs="*", help="YAML files (their reward section), then reward.* / trainer.device overrides"
    )
    reward_server.set_defaults(func=_cmd_reward_server)

    sub.add_parser(
        "procedural-geneval",
        help="the procedural benchmark: supervised base on biased scenes, then Flow-GRPO vs a matched supervised "
        "control (omniflow procedural-geneval --help)",
    )

    export = sub.add_parser(
        "export",
        help="a checkpoint as a diffusers folder: omniflow export CHECKPOINT OUT [--format full|lora|merged] [--no-ema]",
    )
    export.add_argument("checkpoint", help="a global_step_N checkpoint folder, or an experiment folder (its newest)")
    export.add_argument("out", help="new or empty output folder (nothing is overwritten)")
    export.add_argument(
        "--format",
        choices=["full", "lora", "merged"],  # omni_core.checkpoint.export.FORMATS
        help="full: the whole pipeline; lora: the adapter for load_lora_weights; merged: LoRA merged into the "
        "transformer, a whole pipeline (default: lora for a LoRA run, else full)",
    )
    export.add_argument("--ema", action=argparse.BooleanOptionalAction, help="the EMA weights (default: when the run kept them)")
    export.add_argument("--base-model", help="the base pipeline folder (default: the checkpoint config's model path)")
    export.set_defaults(func=_cmd_export)

    evaluate = sub.add_parser(
        "evaluate",
        help="the base model against a checkpoint, same prompts and seeds, the run's reward; a report folder: "
        "omniflow evaluate CHECKPOINT [key=value ...] [--prompts FILE] [--seed S] [--samples N] [--out DIR]",
    )
    _add_evaluate_arguments(evaluate)
    evaluate.set_defaults(func=_cmd_evaluate)

    tiny = sub.add_parser("make-tiny-model", help="build a tiny random-weight pipeline offline (save_pretrained)")
    tiny.add_argument("dir", help="output folder")
    tiny.add_argument("--arch", choices=[*ARCHITECTURES, "clip"], default="sd3")  # clip: a reward model
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument(
        "--max-image-size", type=int, default=None, help="largest image side in px it must sample (sd3: 128 by default)"
    )
    tiny.add_argument(
        "--vae-scale-factor", type=int, choices=(2, 4, 8), default=2, help="8: the real models' latent grid (recipe sizes)"
    )
    tiny.set_defaults(func=_cmd_make_tiny_model)

    ds = sub.add_parser(
        "make-dataset",
        help="write the verl parquet layout from a text file (one prompt per line), or with --pairs verl-omni's offline "
        "DPO layout from a folder of image pairs",
    )
    ds.add_argument("source", help="a .txt file of prompts; with --pairs a folder of <name>.txt, <name>_win.png, <name>_lose.png")
    ds.add_argument("out", help="output .parquet path")
    ds.add_argument("--pairs", action="store_true", help="SOURCE is a folder of preference pairs (offline Diffusion-DPO)")
    ds.add_argument(
        "--data-source",
        default=None,
        help="data_source of every row (prompts: selects the reward, default jpeg_compressibility; pairs: offline_dpo)",
    )
    ds.set_defaults(func=_cmd_make_dataset)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from omni_core.config import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # its own parser (and --help)
        return _cmd_serve(argparse.Namespace(args=argv[1:]))
    if argv[:1] == ["deploy"]:
        return _cmd_deploy(argparse.Namespace(args=argv[1:]))
    if argv[:1] == ["evaluate"]:  # options may sit among the overrides (parse_intermixed_args)
        return _cmd_evaluate(_evaluate_parser().parse_intermixed_args(argv[1:]))
    if argv[:1] == ["procedural-geneval"]:  # its own parser (and --help)
        from omniflow.flows.procedural_geneval import main as procedural_main

        return procedural_main(argv[1:])
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except ConfigError as exc:
        print(f"omniflow: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
