"""Rollout: batched SDE sampling with log-probs into ``Trajectory`` records, and validation sampling.

``trajectory`` is torch-only; ``sampler`` needs the diffusers-backed ``FlowPolicy``. Names are re-exported
lazily so that importing ``omni_core.rollout.trajectory`` alone stays light.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Trajectory": "omni_core.rollout.trajectory",
    "derive_sample_seed": "omni_core.rollout.sampler",
    "generate": "omni_core.rollout.sampler",
    "score_transitions": "omni_core.rollout.sampler",
    "validate_sample": "omni_core.rollout.sampler",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'omni_core.rollout' has no attribute {name!r}")
