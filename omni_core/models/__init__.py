"""Model loading, tiny offline models and the trainable flow policy.

Submodules are imported on use (``from omni_core.models.policy import FlowPolicy``) so that importing the
package stays cheap; the names below are re-exported lazily.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "FlowPolicy": "omni_core.models.policy",
    "ModelLoadError": "omni_core.models.loader",
    "load_pipeline": "omni_core.models.loader",
    "build_tiny_pipeline": "omni_core.models.tiny",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'omni_core.models' has no attribute {name!r}")
