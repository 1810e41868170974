"""Evaluate a model on procedural scenes: deterministic samples at fixed seeds, read by the verifier, summed into tables.

`evaluate_scenes` samples every scene's prompt `samples_per_prompt` times with the ODE sampler (noise level 0) from
noise fixed by `(seed, scene index, sample index)`, so the base, the RL model and the control are compared on the
same noise. `SceneEvaluation.summary` gives what the benchmark reports: accuracy per attribute on seen and held-out
combinations, and for each designed bias the accuracy of its attribute on the prompts it corrupts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from omni_core.models.policy import FlowPolicy
from omni_core.recipes.procedural_geneval.data import CaptionBias, scene_index
from omni_core.recipes.procedural_geneval.scenes import POSITIONS, Scene, all_scenes
from omni_core.recipes.procedural_geneval.verifier import ATTRIBUTES, verify
from omni_core.rollout.sampler import generate

__all__ = ["SceneEvaluation", "evaluate_scenes"]

NUM_STEPS = 10
MAX_SEQUENCE_LENGTH = 16


@dataclass
class SceneEvaluation:
    """One row per sample: its scene, whether the scene was held out, and the verifier's per-attribute verdicts."""

    scenes: list[Scene]
    held_out: list[bool]
    correct: dict[str, np.ndarray]  # attribute (and "all") -> bool [N]
    images: torch.Tensor  # uint8 [N, 3, H, W], sample-major within each scene

    def accuracy(self, attribute: str, mask: np.ndarray | None = None) -> float | None:
        """Share of samples (within `mask`) whose `attribute` is right; None when the mask selects nothing."""
        values = self.correct[attribute] if mask is None else self.correct[attribute][mask]
        return float(values.mean()) if values.size else None

    def mask(self, predicate) -> np.ndarray:
        return np.array([bool(predicate(s, h)) for s, h in zip(self.scenes, self.held_out, strict=True)])

    def summary(self, biases: Sequence[CaptionBias]) -> dict:
        """Accuracy per attribute (all, seen, held-out); per bias, its attribute on the prompts it corrupts; per other
        attribute, accuracy on the prompts no bias corrupts for it; and position accuracy per position."""
        seen, held = self.mask(lambda s, h: not h), self.mask(lambda s, h: h)
        out: dict = {"overall": {}, "biases": {}, "unbiased": {}, "per_position": {}}
        for attribute in (*ATTRIBUTES, "all"):
            out["overall"][attribute] = {
                "all": self.accuracy(attribute),
                "seen": self.accuracy(attribute, seen),
                "held_out": self.accuracy(attribute, held),
            }
        for bias in biases:
            hit = self.mask(lambda s, h, b=bias: b.applies_to(s))
            out["biases"][bias.label] = {
                "attribute": bias.attribute,
                "prompts": len({s for s, h in zip(self.scenes, hit, strict=True) if h}),
                "samples": int(hit.sum()),
                "all": self.accuracy(bias.attribute, hit),
                "seen": self.accuracy(bias.attribute, hit & seen),
                "held_out": self.accuracy(bias.attribute, hit & held),
                "all_attributes": self.accuracy("all", hit),
            }
        for attribute in ATTRIBUTES:
            corrupted = [b for b in biases if b.attribute == attribute]
            clean = self.mask(lambda s, h, c=corrupted: not any(b.applies_to(s) for b in c))
            out["unbiased"][attribute] = self.accuracy(attribute, clean)
        for position in POSITIONS:
            out["per_position"][position] = self.accuracy("position", self.mask(lambda s, h, p=position: s.position == p))
        return out


@torch.no_grad()
def evaluate_scenes(
    policy: FlowPolicy,
    held_out: Sequence[Scene],
    scenes: Sequence[Scene] | None = None,
    samples_per_prompt: int = 2,
    seed: int = 0,
    image_size: int = 32,
    batch_prompts: int = 60,
) -> SceneEvaluation:
    """Sample `scenes` (default all 120) deterministically and verify every image against its prompt."""
    scenes = list(scenes) if scenes is not None else all_scenes()
    held = set(held_out)
    was_training = policy.transformer.training
    policy.transformer.eval()
    images = []
    try:
        for start in range(0, len(scenes), batch_prompts):
            chunk = scenes[start : start + batch_prompts]
            traj = generate(
                policy,
                [s.prompt for s in chunk],
                n=samples_per_prompt,
                seed=seed,
                global_step=0,
                prompt_indices=[scene_index(s) for s in chunk],
                height=image_size,
                width=image_size,
                num_inference_steps=NUM_STEPS,
                noise_level=0.0,
                max_sequence_length=MAX_SEQUENCE_LENGTH,
                calculate_log_probs=False,
            )
            images.append(traj.images)
    finally:
        policy.transformer.train(was_training)
    all_images = torch.cat(images)
    per_sample = [s for s in scenes for _ in range(samples_per_prompt)]
    verdicts = [verify(img.permute(1, 2, 0).numpy(), s) for img, s in zip(all_images, per_sample, strict=True)]
    correct = {k: np.array([v[k] for v in verdicts]) for k in (*ATTRIBUTES, "all")}
    return SceneEvaluation(per_sample, [s in held for s in per_sample], correct, all_images)
