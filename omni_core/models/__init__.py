"""Models, one module each: loading a saved pipeline (`loader`), the trainable flow policy (`policy`), LoRA
(`lora`), architecture adapters (`arch`), the tiny offline test models (`tiny`) and the base model of a
pipeline run (`base_model`).

Import from the submodules (`from omni_core.models.policy import FlowPolicy`). The package only installs
the filters for library notices that call for no action (`omni_core.quiet`) before any submodule
imports diffusers; it imports nothing heavy itself.
"""

from omni_core.quiet import drop_library_notices

drop_library_notices()
