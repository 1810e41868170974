"""The SDE's default noise level and type, once for every signature that takes them.

`omni_core.sde`, the rollout sampler, `SamplingParams` and the reference loop (`benchmarks/reference_loop.py`)
default to these. The user-facing defaults are `actor_rollout_ref.rollout.algo.{noise_level,sde_type}` in
`omni_core/config/defaults.yaml`, which a run always passes; a test checks that the two agree. Plain Python on
purpose: `SamplingParams`, a record the flow process and the workers share, imports no torch (so not `omni_core.sde`).
"""

from __future__ import annotations

NOISE_LEVEL: float = 0.7  # flow_grpo's default (verl-omni's is 1.0)
SDE_TYPE: str = "sde"  # Flow-GRPO's Euler-Maruyama step (omni_core.sde.SDE_TYPES)
