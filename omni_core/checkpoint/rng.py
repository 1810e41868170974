"""Controller RNG state as JSON: python `random`, numpy (if installed) and torch's CPU / CUDA generators.

Saved with each checkpoint so a resumed run draws the same numbers as an uninterrupted one. Plain lists
of ints, never pickle, so the state is readable and loading it cannot run code.
"""

from __future__ import annotations

import random
from typing import Any


def capture_rng_state() -> dict[str, Any]:
    import torch

    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {
        "kind": kind,
        "keys": keys.tolist(),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore what `capture_rng_state` saved; generators missing from `state` are left as they are."""
    import torch

    if "python" in state:
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    if "torch" in state:
        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["torch_cuda"]])
    if "numpy" in state:
        import numpy as np

        np_state = state["numpy"]
        np.random.set_state(
            (
                np_state["kind"],
                np.array(np_state["keys"], dtype=np.uint32),
                np_state["pos"],
                np_state["has_gauss"],
                np_state["cached_gaussian"],
            )
        )
