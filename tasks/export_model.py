"""Pipeline stage 4 — `export_model`: the trained transformer (full fine-tuning) or LoRA adapter in
diffusers format, loadable with `from_pretrained` / `load_lora_weights` (verl-omni's
`model_merger`, for diffusers)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from omni_core.export import ExportInfo, export_checkpoint


@task(name="export_model", cache_policy=NO_CACHE, retries=1)
def export_model(base_model: str, checkpoint: str, out_dir: str) -> ExportInfo:
    """Write the export into `out_dir` (replaced if present) with an `export_info.json`."""
    info = export_checkpoint(base_model, checkpoint, out_dir)
    print(f"exported {info.kind} weights of {checkpoint} to {info.out_dir}")
    return info
