"""`diffusion_nft`, the registered loss: DiffusionNFT's forward-process objective, on the contract.

Declares the group advantages (mapped here to the optimality probability by `algorithm.adv_mode`, which reaches the loss
as an option, and `adv_clip_max`), the final latents and a forward-process point of them (`forward_latents` at
`forward_sigma`), the current and the old policy's velocity there and, with `ref_kl_coef` > 0, the reference's. The
math is `omni_core.algorithms.diffusion_nft`'s (`nft_loss`, where the equations are written out). Keys: `mix_beta`,
`ref_kl_coef`, `adaptive_weight_min` (its own) and `adv_clip_max`.
"""

from __future__ import annotations

from torch import Tensor

from omni_core.algorithms.diffusion_nft import nft_loss, reward_probability
from omni_core.algorithms.loss_contract import LossInputs, LossSettings

__all__ = ["LOSS", "DiffusionNFTLoss"]

NEEDS = frozenset({"advantages", "final_latents", "forward_latents", "forward_sigma", "velocity", "old_velocity"})


class DiffusionNFTLoss:
    group_size = 1

    def inputs(self, settings: LossSettings) -> frozenset[str]:
        return NEEDS | ({"ref_velocity"} if float(settings.options["ref_kl_coef"]) > 0 else frozenset())

    def __call__(self, x: LossInputs, settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
        assert x.advantages is not None and x.velocity is not None and x.old_velocity is not None
        assert x.final_latents is not None and x.forward_latents is not None and x.forward_sigma is not None
        options = settings.options
        reward_prob = reward_probability(x.advantages, settings.adv_clip_max, str(options["adv_mode"]))
        return nft_loss(
            x.velocity,
            x.old_velocity,
            x.final_latents,
            x.forward_latents,
            x.forward_sigma,
            reward_prob.to(x.velocity.device),
            mix_beta=float(options["mix_beta"]),
            adv_clip_max=settings.adv_clip_max,
            adaptive_weight_min=float(options["adaptive_weight_min"]),
            ref_velocity=x.ref_velocity,
            ref_kl_coef=float(options["ref_kl_coef"]),
        )


LOSS = DiffusionNFTLoss()
