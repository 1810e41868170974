"""Model loading, tiny offline models and the trainable flow policy.

Submodules are imported on use (``from omni_core.models.policy import FlowPolicy``) so that importing the
package stays cheap; the names below are re-exported lazily.
"""

from omni_core._lazy import lazy_exports
from omni_core.quiet import drop_library_notices

drop_library_notices()  # before any submodule imports diffusers (it imports nothing itself)

_EXPORTS = {
    "FlowPolicy": "omni_core.models.policy",
    "ModelLoadError": "omni_core.models.loader",
    "load_pipeline": "omni_core.models.loader",
    "build_tiny_pipeline": "omni_core.models.tiny",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
