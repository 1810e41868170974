"""`dpo`, the registered loss: Diffusion-DPO on (chosen, rejected) pairs, on the contract.

Pairs of adjacent samples (`group_size` 2: the update never splits one), each noised at one shared forward-process
point: the loss declares the samples' rewards (the pair's order and its ties), the final latents and the shared noise
(the velocity target is ``noise - final_latents``), and the current and the reference policy's velocity there. The
math is `omni_core.algorithms.diffusion_dpo`'s (`dpo_loss`). Its own key: `dpo_beta`.
"""

from __future__ import annotations

from torch import Tensor

from omni_core.algorithms.diffusion_dpo import dpo_loss
from omni_core.algorithms.loss_contract import LossInputs, LossSettings

__all__ = ["LOSS", "DiffusionDPOLoss"]

NEEDS = frozenset({"rewards", "final_latents", "forward_noise", "velocity", "ref_velocity"})


class DiffusionDPOLoss:
    group_size = 2
    # Its forward-process points: one per pair, sigma drawn logit-normal from the training schedule (not the rollout's).
    forward_sigmas = "train_schedule"

    def inputs(self, settings: LossSettings) -> frozenset[str]:
        return NEEDS

    def __call__(self, x: LossInputs, settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
        assert x.velocity is not None and x.ref_velocity is not None and x.rewards is not None
        assert x.final_latents is not None and x.forward_noise is not None
        return dpo_loss(
            x.velocity, x.ref_velocity, x.final_latents, x.forward_noise, x.rewards, float(settings.options["dpo_beta"])
        )


LOSS = DiffusionDPOLoss()
