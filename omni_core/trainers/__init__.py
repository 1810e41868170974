"""v1 diffusion trainers: the registry (light), the base class with its hooks and the registered modes.

`from omni_core.trainers import get_diffusion_trainer_cls` stays light; the trainer classes (which
import Ray and diffusers) load on first use.
"""

from omni_core.trainers.registry import (
    build_diffusion_trainer,
    get_diffusion_trainer_cls,
    register_diffusion_trainer,
    registered_modes,
)

__all__ = ["build_diffusion_trainer", "get_diffusion_trainer_cls", "register_diffusion_trainer", "registered_modes"]
