"""The names `trainer.v1.trainer_mode` takes: the built-in modes and any a package registers, without the trainers.

The trainer classes live three layers up (`omni_core.trainers`, with Ray and diffusers); validation, which runs
before anything starts, needs only their names. `omni_core.trainers.registry.register_diffusion_trainer` adds each
name it registers here, so a mode a user registers validates too.
"""

from __future__ import annotations

__all__ = ["BUILTIN_TRAINER_MODES", "add_trainer_mode", "trainer_mode_names"]

# The modes `omni_core.trainers` registers (verl-omni's trainer_sync.py / trainer_separate_async.py).
BUILTIN_TRAINER_MODES = ("separate_async", "sync")

_ADDED: set[str] = set()


def add_trainer_mode(name: str) -> None:
    """Record a registered mode's name (called by the trainer registry)."""
    _ADDED.add(name)


def trainer_mode_names() -> list[str]:
    """Built-in modes plus any registered so far, sorted."""
    return sorted(set(BUILTIN_TRAINER_MODES) | _ADDED)
