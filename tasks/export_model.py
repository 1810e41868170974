"""Pipeline stage 4 — `export_model`: the trained transformer (full fine-tuning) or LoRA adapter in
diffusers format, loadable with `from_pretrained` / `load_lora_weights` (verl-omni's
`model_merger`, for diffusers), with its model card, and registered in mlflow when the run tracked there.

The export is a Prefect asset, `file://<absolute export folder>` (`export_asset`): the task materializes it, so the
Prefect UI's lineage shows it and a downstream flow can depend on it (`@task(asset_deps=[export_asset(folder)])`).
The key is the folder, known only when the flow calls the stage, so `export_model` makes its materializing task per
call; the orchestration policy is the one `materialize(...)` call below.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from prefect.assets import Asset, AssetProperties, add_asset_metadata, materialize
from prefect.cache_policies import NO_CACHE

from omni_core.export import ExportInfo, export_checkpoint


def export_asset(out_dir: str | Path) -> Asset:
    """The asset an export folder is: key `file://<absolute path>` (a path with a space, `#`, `?`, `%` or a quote
    cannot be a Prefect asset key: the error names it)."""
    path = Path(out_dir).expanduser().resolve()
    try:
        return Asset(
            key=f"file://{path}",
            properties=AssetProperties(name=f"omniflow export {path.name}", description="A diffusers model folder"),
        )
    except ValueError as exc:
        raise ValueError(f"export_dir={path} cannot be a Prefect asset key ({exc}); choose a folder path without it") from exc


def _export(base_model: str, checkpoint: str, out_dir: str) -> ExportInfo:
    info = export_checkpoint(base_model, checkpoint, out_dir)
    add_asset_metadata(export_asset(out_dir), {k: v for k, v in asdict(info).items() if v is not None})
    print(f"exported {info.kind} weights of {checkpoint} to {info.out_dir} ({info.linked_files} base files linked)")
    if info.registered_model:
        print(f"registered in mlflow's model registry as {info.registered_model}")
    return info


def export_model(base_model: str, checkpoint: str, out_dir: str) -> ExportInfo:
    """Write the export into `out_dir` (an earlier export there is replaced) with `export_info.json` and `README.md`,
    as the task run that materializes `export_asset(out_dir)` (its metadata: the `ExportInfo`)."""
    task = materialize(export_asset(out_dir), name="export_model", cache_policy=NO_CACHE, retries=1)(_export)
    return task(base_model, checkpoint, out_dir)
