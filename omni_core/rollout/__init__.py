"""Rollout: batched SDE sampling with log-probs into ``Trajectory`` records, and validation sampling.

``trajectory`` is torch-only and ``sampling_params`` is plain Python; ``sampler`` needs the
diffusers-backed ``FlowPolicy``. Names are re-exported lazily so that importing a light submodule
stays light.
"""

from omni_core._lazy import lazy_exports

_EXPORTS = {
    "SamplingParams": "omni_core.rollout.sampling_params",
    "Trajectory": "omni_core.rollout.trajectory",
    "derive_sample_seed": "omni_core.rollout.sampler",
    "generate": "omni_core.rollout.sampler",
    "score_transitions": "omni_core.rollout.sampler",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
