"""Helpers of the main-job tests: final weights of a run, a run with a process killed mid-way."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file

# The lean config (conftest's flow_overrides) on two data-parallel training ranks (actor.strategy=ddp, gloo on CPU).
TWO_RANKS = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.strategy=ddp"]


def final_weights(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    root = Path(checkpoint_dir)
    step = int((root / "latest_checkpointed_iteration.txt").read_text().strip())
    return load_file(str(root / f"global_step_{step}" / "actor" / "model.safetensors"))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def kill_when(ckpt, name_part: str, class_name: str, killed: list[int], timeout_s: float = 400) -> None:
    """Once `ckpt/global_step_1` is complete, SIGKILL the live actor of class `class_name` whose name holds
    `name_part` (pid from Ray's state API)."""
    import signal
    import time

    import ray
    from ray.util.state import list_actors

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not (ckpt / "global_step_1" / "manifest.json").exists():
        time.sleep(0.2)
    actors = list_actors(
        address=ray.get_runtime_context().gcs_address,
        filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")],
        detail=True,
        limit=1000,
    )
    for actor in actors:
        if name_part in (actor.name or ""):
            os.kill(actor.pid, signal.SIGKILL)
            killed.append(actor.pid)


def run_with_kill(flow_overrides, ckpt, experiment: str, name_part: str, class_name: str):
    import threading

    from omniflow.flows.main_diffusion_v1 import main_diffusion_v1

    killed: list[int] = []
    watcher = threading.Thread(target=kill_when, args=(ckpt, name_part, class_name, killed), daemon=True)
    watcher.start()
    state = main_diffusion_v1(
        overrides=[*flow_overrides, f"trainer.default_local_dir={ckpt}", f"trainer.experiment_name={experiment}"],
        return_state=True,
    )
    watcher.join(timeout=30)
    return state, killed
