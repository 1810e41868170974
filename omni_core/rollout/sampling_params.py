"""``SamplingParams``: how one rollout request samples, built by the trainer and carried with the request.

The trainer decides per request (a training step or a validation) how many samples per prompt, the
seed, steps, noise level, guidance, SDE window and whether log-probs are recorded, and sends that
decision with the prompts, as vLLM's ``SamplingParams`` travels with a generation request. Workers and
the evaluation never re-derive it from the config. Plain Python (no torch): the controller, the
workers and the evaluation all import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omni_core.rollout.mix_windows import MixWindow
from omni_core.sde_defaults import NOISE_LEVEL, SDE_TYPE


@dataclass(frozen=True)
class SamplingParams:
    """The keyword arguments of ``omni_core.rollout.sampler.generate`` for one request, plus ``fixed_noise``.

    Attributes:
        n: samples per prompt (the GRPO group size in training).
        seed: base seed of every per-sample seed (``derive_sample_seed``).
        height, width: image size in pixels.
        num_inference_steps: denoising steps.
        guidance_scale: the pipeline's ``guidance_scale``: SD3's CFG scale; FLUX.1-dev's guidance embedding.
        true_cfg_scale: the pipeline's ``true_cfg_scale``: FLUX's and Qwen-Image's CFG scale (SD3: always 1.0).
            Which of the two is CFG is the architecture's (``ArchAdapter.cfg_scale``); above 1.0 the prompts'
            negative prompts are used.
        noise_level: SDE noise (0 = the deterministic Euler ODE step everywhere).
        sde_type: ``sde`` (Flow-GRPO), ``cps`` or ``dance_sde`` (DanceGRPO).
        sde_window_size, sde_window_range: the SDE window (see ``omni_core.sde.sample_sde_windows``).
        max_sequence_length: text-encoder tokens.
        calculate_log_probs: record each in-window step's log-prob (``rollout.calculate_log_probs``: bypass
            mode trains on them, and the trainer reports their drift from its own recomputation).
        record_window: keep the SDE window (latents, timesteps, prompt embeddings) for training; False keeps
            only the images and scores (validation).
        mix_window: MixGRPO's window schedule (``model.algorithm=mix_grpo``): the step's window replaces the range.
        init_same_noise: every sample of a prompt group starts from the group's one initial noise (DanceGRPO).
        fixed_noise: seed every request as global step 0, so the same prompt gets the same noise at every
            evaluation and images are comparable across steps (validation); False reseeds per step.
        old_policy: sample with the old policy (``rollout.rollout_adapter=old``, DiffusionNFT's training rollouts)
            instead of the trained one.

    ``model.algorithm=diffusion_nft`` samples with the deterministic Euler ODE at every step (noise level 0) and records
    every step (the window is the whole schedule): DiffusionNFT trains on the final latents at the schedule's sigmas
    and needs no log-probs. ``model.algorithm=dpo`` samples with the same ODE and records only the last step (the
    final latents are all Diffusion-DPO trains on).
    """

    n: int
    seed: int
    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float = 1.0
    true_cfg_scale: float = 1.0
    noise_level: float = NOISE_LEVEL
    sde_type: str = SDE_TYPE
    sde_window_size: int | None = None
    sde_window_range: tuple[int, int] | None = None
    max_sequence_length: int = 128
    calculate_log_probs: bool = True
    record_window: bool = True
    fixed_noise: bool = False
    mix_window: MixWindow | None = None
    init_same_noise: bool = False
    old_policy: bool = False

    @classmethod
    def for_training(cls, rollout: Any, model_algorithm: str = "flow_grpo") -> SamplingParams:
        """A training step's sampling, from the ``actor_rollout_ref.rollout`` config section; ``model_algorithm``
        (``actor_rollout_ref.model.algorithm``) ``mix_grpo`` places each step's SDE window by MixGRPO's schedule."""
        algo = rollout.algo
        mix = (
            MixWindow(algo.sample_strategy, algo.iters_per_group, algo.sde_window_seed) if model_algorithm == "mix_grpo" else None
        )
        if model_algorithm in ("diffusion_nft", "dpo"):  # the ODE over the whole schedule, no log-probs
            steps = rollout.pipeline.num_inference_steps
            first = 0 if model_algorithm == "diffusion_nft" else steps - 1  # NFT: every step recorded; DPO: the last
            return cls.for_training(rollout).replace(
                noise_level=0.0,
                sde_window_size=steps - first,
                sde_window_range=(first, steps),
                calculate_log_probs=False,
                init_same_noise=False,
                old_policy=rollout.rollout_adapter == "old",
            )
        return cls(
            n=rollout.n,
            seed=rollout.seed or 0,
            height=rollout.pipeline.height,
            width=rollout.pipeline.width,
            num_inference_steps=rollout.pipeline.num_inference_steps,
            guidance_scale=rollout.pipeline.guidance_scale,
            true_cfg_scale=rollout.pipeline.true_cfg_scale,
            noise_level=rollout.algo.noise_level,
            sde_type=rollout.algo.sde_type,
            sde_window_size=rollout.algo.sde_window_size,
            sde_window_range=tuple(rollout.algo.sde_window_range) if rollout.algo.sde_window_range else None,
            max_sequence_length=rollout.pipeline.max_sequence_length,
            calculate_log_probs=rollout.calculate_log_probs,
            record_window=True,
            fixed_noise=False,
            mix_window=mix,
            init_same_noise=algo.sde_type == "dance_sde" if algo.init_same_noise is None else algo.init_same_noise,
        )

    @classmethod
    def for_validation(cls, rollout: Any) -> SamplingParams:
        """Validation sampling (verl-omni's ``rollout.val_kwargs``): its own n, seed, steps and noise
        level (0 = deterministic), fixed noise across evaluations, no log-probs."""
        val = rollout.val_kwargs
        return dataclasses.replace(
            cls.for_training(rollout),
            n=val.n,
            seed=val.seed,
            num_inference_steps=val.pipeline.num_inference_steps,
            noise_level=val.algo.noise_level,
            calculate_log_probs=False,
            record_window=False,
            fixed_noise=True,
            mix_window=None,
            init_same_noise=False,
            old_policy=False,
        )

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    def negative_prompts(self, negative_prompts: Sequence[str | None]) -> list[str] | None:
        """The negative prompts to sample with: only when a guidance scale is above 1 (the sampler uses them when
        the architecture's CFG scale is); a missing one is ``""``."""
        return [p or "" for p in negative_prompts] if max(self.guidance_scale, self.true_cfg_scale) > 1.0 else None

    def generate_kwargs(self, global_step: int) -> dict[str, Any]:
        """``generate``'s keyword arguments for a request made at ``global_step``."""
        kwargs = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("fixed_noise", "record_window", "mix_window", "old_policy")
        }
        kwargs["global_step"] = 0 if self.fixed_noise else global_step
        if self.mix_window is not None:  # MixGRPO: every sample of the step in the step's window
            assert self.sde_window_size is not None and self.sde_window_range is not None  # validation
            kwargs["sde_window_range"] = self.mix_window.range_at(global_step, self.sde_window_size, self.sde_window_range)
        return kwargs
