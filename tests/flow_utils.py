"""Helpers of the main-job tests: final weights of a run, Prefect API queries."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file


def final_weights(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    root = Path(checkpoint_dir)
    step = int((root / "latest_checkpointed_iteration.txt").read_text().strip())
    return load_file(str(root / f"global_step_{step}" / "actor" / "model.safetensors"))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"
