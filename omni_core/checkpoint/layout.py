"""Names and paths of the checkpoint folder, laid out as verl's.

```
<root>/
  latest_checkpointed_iteration.txt   the newest committed step, e.g. "40"
  .omniflow.lock                      the run using this folder (RunLock)
  global_step_<N>/                    one complete checkpoint (appears by an atomic rename)
    actor/                            written by the training actor (model, optimizer, LR scheduler)
    <name>.json / .safetensors / .pt  controller state: dataloader, controller, RNG, ...
    config.yaml                       the resolved run config
    manifest.json                     files, sizes, sha256s, step, created time (written last)
  .tmp_global_step_<N>_<pid>/         a checkpoint being written, or left by a crash
  logs/<run id>/metrics.jsonl         each run's step metrics (the `file` logger), run id in controller.json
```

Only this module knows these names; the rest of the package asks it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

STEP_PREFIX = "global_step_"
LATEST_FILE = "latest_checkpointed_iteration.txt"
MANIFEST_FILE = "manifest.json"
CONFIG_FILE = "config.yaml"
ACTOR_DIR = "actor"
EMA_NAME = "ema"  # <checkpoint>/actor/ema.safetensors: the moving average of the weights (actor.ema)
# DiffusionNFT's old policy (`model.policy_state_adapters` [default, old]): actor/old_policy.safetensors, keyed as the model.
OLD_POLICY_NAME = "old_policy"
LOCK_FILE = ".omniflow.lock"
TMP_PREFIX = ".tmp_"
LOGS_DIR = "logs"  # <root>/logs/<run id>/: one run's metrics (metrics.jsonl), TensorBoard and validation images

_STEP_RE = re.compile(rf"^{STEP_PREFIX}(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or not ours; the message names the path and the fix."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"{STEP_PREFIX}{int(step)}"


def tmp_dir(root: str | Path, step: int) -> Path:
    # The pid keeps two writers of the same step (a retry in a new process) from sharing a folder.
    return Path(root) / f"{TMP_PREFIX}{STEP_PREFIX}{int(step)}_{os.getpid()}"


def run_log_dir(root: str | Path, run_id: str) -> Path:
    """Where the run `run_id` of the checkpoint folder `root` logs its metrics: `<root>/logs/<run id>`."""
    return Path(root) / LOGS_DIR / run_id


def parse_step(path: str | Path) -> int | None:
    """N for a folder named global_step_N, else None."""
    m = _STEP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def is_complete(path: str | Path) -> bool:
    """A committed checkpoint: a global_step_N folder holding a manifest (written before the rename)."""
    path = Path(path)
    return parse_step(path) is not None and path.is_dir() and (path / MANIFEST_FILE).is_file()


def complete_steps(root: str | Path) -> dict[int, Path]:
    """Every committed checkpoint under `root`, by step; `.tmp_*` folders never count."""
    root = Path(root)
    if not root.is_dir():
        return {}
    return {parse_step(p): p for p in root.iterdir() if is_complete(p)}  # type: ignore[misc]


def read_latest_step(root: str | Path) -> int | None:
    """The step named in latest_checkpointed_iteration.txt, or None when absent or unreadable."""
    try:
        return int((Path(root) / LATEST_FILE).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def step_of(ckpt: str | Path) -> int:
    """The global step of a checkpoint folder, parsed from its name as verl does."""
    step = parse_step(ckpt)
    if step is None:
        raise CheckpointError(f"{ckpt}: not a global_step_N folder")
    return step
