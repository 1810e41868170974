"""Exponential moving average of the trained weights (flow_grpo's ``train.ema``), plain tensors in and out.

After training step ``s`` (the global step whose update produced the weights ``theta_s``):

    s <  start_step:                       ema = theta_s                     (the average starts at start_step)
    s >= start_step, (s - start_step) % update_interval == 0:
        k     = s - start_step
        d     = min(decay, (1 + k) / (10 + k))                               (flow_grpo's warm-up of the decay)
        ema   = ema + (1 - d) * (theta_s - ema)
    otherwise:                             ema unchanged

With the warm-up the first averaged steps weigh the new weights heavily (d = 0.1 at k = 0, 0.18 at k = 1, ...),
so an early average is not dominated by the base model; ``decay`` caps d. The average is kept in fp32 on the
weights' device, one tensor per entry of the trainable state (the LoRA adapter, or the whole transformer);
integer entries (none in practice) are copied.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["WeightsEMA", "ema_decay"]


def ema_decay(steps_since_start: int, decay: float) -> float:
    """flow_grpo's decay at ``steps_since_start`` averaged steps: ``min(decay, (1 + k) / (10 + k))``."""
    k = steps_since_start
    return min(decay, (1 + k) / (10 + k))


class WeightsEMA:
    """The moving average of one trainable state dict (see the module docstring for the rule)."""

    def __init__(self, weights: Mapping[str, Tensor], decay: float, start_step: int = 0, update_interval: int = 1) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"actor_rollout_ref.actor.ema.decay={decay} must be in [0, 1)")
        if start_step < 0 or update_interval < 1:
            raise ValueError(
                f"actor_rollout_ref.actor.ema.start_step={start_step} must be >= 0 and update_interval={update_interval} >= 1"
            )
        self.decay, self.start_step, self.update_interval = decay, start_step, update_interval
        self.average: dict[str, Tensor] = {k: _fp32_copy(v) for k, v in weights.items()}

    @torch.no_grad()
    def step(self, weights: Mapping[str, Tensor], global_step: int) -> float | None:
        """Fold the weights after training step ``global_step`` in; returns the decay used (None: not averaged)."""
        if global_step < self.start_step:
            for name, avg in self.average.items():
                avg.copy_(weights[name])
            return None
        k = global_step - self.start_step
        if k % self.update_interval:
            return None
        d = ema_decay(k, self.decay)
        for name, avg in self.average.items():
            w = weights[name].detach()
            if avg.is_floating_point():
                avg.add_(w.to(avg.device, avg.dtype) - avg, alpha=1.0 - d)
            else:
                avg.copy_(w)
        return d

    def state_dict(self) -> dict[str, Tensor]:
        """The averaged tensors (the trainable state's keys), for a checkpoint."""
        return {k: v.detach().clone() for k, v in self.average.items()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Restore the average of a checkpoint; its keys must be the trainable state's."""
        missing, unexpected = sorted(set(self.average) - set(state)), sorted(set(state) - set(self.average))
        if missing or unexpected:
            raise ValueError(
                f"the checkpoint's EMA weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        for name, avg in self.average.items():
            avg.copy_(state[name])


def _fp32_copy(t: Tensor) -> Tensor:
    t = t.detach()
    return t.to(torch.float32, copy=True) if t.is_floating_point() else t.clone()
