"""The trainer-mode registry: `@register_diffusion_trainer("sync")` and `get_diffusion_trainer_cls`.

A thin dict keyed by the names users type in `trainer.v1.trainer_mode`, as in verl-omni's
`trainer_base.py`. Registration happens when `omni_core.trainers` is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from omni_core.config.trainer_modes import BUILTIN_TRAINER_MODES, add_trainer_mode

T = TypeVar("T", bound=type)

DIFFUSION_TRAINER_REGISTRY: dict[str, type] = {}

# The modes `omni_core.trainers.modes` registers, known without importing it (it pulls in Ray and
# diffusers), so that `validate_config` stays fast and light: the names live in the config layer.
BUILTIN_MODES = BUILTIN_TRAINER_MODES


def register_diffusion_trainer(name: str) -> Callable[[T], T]:
    """Class decorator: register a trainer class under the mode name users type."""

    def decorate(cls: T) -> T:
        if name in DIFFUSION_TRAINER_REGISTRY and DIFFUSION_TRAINER_REGISTRY[name] is not cls:
            raise ValueError(f"trainer mode {name!r} is already registered by {DIFFUSION_TRAINER_REGISTRY[name].__name__}")
        DIFFUSION_TRAINER_REGISTRY[name] = cls
        add_trainer_mode(name)  # validation reads the names there
        return cls

    return decorate


def registered_modes() -> list[str]:
    """Built-in modes plus any registered so far (without importing the trainer classes)."""
    return sorted(set(BUILTIN_MODES) | set(DIFFUSION_TRAINER_REGISTRY))


def get_diffusion_trainer_cls(name: str) -> type:
    """The trainer class registered as `name`; an unknown name lists the registered modes."""
    import omni_core.trainers.modes  # noqa: F401  (registers the built-in modes)

    modes = registered_modes()
    if name not in DIFFUSION_TRAINER_REGISTRY:
        raise ValueError(f"unknown trainer mode {name!r} (trainer.v1.trainer_mode); available: {', '.join(modes)}")
    return DIFFUSION_TRAINER_REGISTRY[name]


def build_diffusion_trainer(config: Any, run: Any) -> Any:
    """`get_diffusion_trainer_cls(config.trainer.v1.trainer_mode)(config, run)`: the run's controller; with offline
    samples (`algorithm.sample_source=offline`, sync mode only) the sync trainer fed by the data set's pairs."""
    if config.algorithm.sample_source == "offline":
        from omni_core.trainers.modes import PreferenceDataTrainerV1

        return PreferenceDataTrainerV1(config, run)
    return get_diffusion_trainer_cls(config.trainer.v1.trainer_mode)(config, run)
