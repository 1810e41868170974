"""MixGRPO's SDE window schedule (`actor_rollout_ref.model.algorithm=mix_grpo`): where each training step's window is.

MixGRPO samples with Flow-GRPO's SDE inside a window of `sde_window_size` steps and the ODE outside it, as Flow-GRPO-Fast
does; what differs is how the window is placed. Every sample of a step gets the same window, as verl-omni's MixGRPO
rollout adapter places it (the rule is written out there; no code is copied), inside `sde_window_range = [lo, hi)`:

* `random`: start = Python's `random.Random(sde_window_seed + global_step).randint(lo, hi - size)`: a new window every
  step, the same on every rank and rollout worker (it depends on the step alone);
* `progressive`: start = min(lo + (global_step // iters_per_group) * size, hi - size): the window slides by its own
  size every `iters_per_group` steps and stays at the end of the range once there.

The window is the range `[start, start + size)` handed to the sampler, whose draw then has one start to pick.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

STRATEGIES = ("random", "progressive")


@dataclass(frozen=True)
class MixWindow:
    """`rollout.algo.{sample_strategy, iters_per_group, sde_window_seed}`."""

    strategy: str
    iters_per_group: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"sample_strategy={self.strategy!r} must be one of {STRATEGIES}")
        if self.iters_per_group < 1:
            raise ValueError(f"iters_per_group={self.iters_per_group} must be >= 1")

    def range_at(self, global_step: int, size: int, window_range: tuple[int, int]) -> tuple[int, int]:
        """The window `[start, start + size)` of training step `global_step`."""
        lo, hi = int(window_range[0]), int(window_range[1])
        last = hi - size
        if last < lo:
            raise ValueError(f"MixGRPO window of sde_window_size={size} does not fit sde_window_range=[{lo}, {hi})")
        if self.strategy == "random":
            start = random.Random(self.seed + global_step).randint(lo, last)
        else:
            start = min(lo + max(0, global_step) // self.iters_per_group * size, last)
        return start, start + size
