"""How far off-policy a prompt group is, in verl's two units, and the per-step off-policy metrics.

Both as verl / verl-omni define them (separate_async):

* **span** (verl's ``ReplayBuffer``, the unit of ``trainer.v1.sampler.max_off_policy_threshold``): global steps since
  the prompt was submitted, counting the step that trains it, ``span = step - submitted + 1``. A finished group
  with ``span > threshold`` is evicted (``drop``); with ``wait``, sampling holds while a group in flight has
  ``span >= threshold``. A batch put ``num_warmup_batches`` steps ahead is trained at span
  ``num_warmup_batches + 1``.
* **staleness** (verl-omni's ``training/off_policy/trajectory_staleness`` metrics): model versions between the
  weights that sampled a trajectory and the weights training it, ``(step - 1) - version``, where a weight version is
  the global step whose update produced the weights (0: the base model). 0 is on-policy (sync mode).
"""

from __future__ import annotations

from collections.abc import Sequence


def span(train_step: int, submitted_step: int) -> int:
    """verl's replay-buffer span of a prompt submitted at ``submitted_step`` and trained at ``train_step``."""
    return train_step - submitted_step + 1


def staleness(train_step: int, version: int) -> int:
    """Model versions between the weights that sampled a trajectory (``version``) and those training at ``train_step``."""
    return train_step - 1 - version


def _stats(name: str, values: Sequence[float]) -> dict[str, float]:
    return {f"{name}/mean": sum(values) / len(values), f"{name}/max": max(values), f"{name}/min": min(values)}


def staleness_metrics(per_trajectory: Sequence[float], evicted_spans: Sequence[int]) -> dict[str, float]:
    """verl-omni's off-policy metrics of one step, under ``training/off_policy/``:

    * ``trajectory_staleness/{mean,max,min}`` over the trained trajectories, and ``trajectory_staleness_worst/...``
      and ``trajectory_spans/...`` (verl-omni's, for trajectories that may span several weight versions; a diffusion
      trajectory is sampled with one, so ``worst`` equals ``staleness`` and every span is 1);
    * verl's replay-buffer eviction metrics: ``evicted_samples`` (prompt groups evicted as over-stale this step) and
      ``evicted_samples_staleness/{mean,max,min}`` (their spans), when any was."""
    prefix = "training/off_policy"
    metrics = {f"{prefix}/evicted_samples": float(len(evicted_spans))}
    if evicted_spans:
        metrics |= _stats(f"{prefix}/evicted_samples_staleness", [float(s) for s in evicted_spans])
    if per_trajectory:
        values = [float(v) for v in per_trajectory]
        metrics |= _stats(f"{prefix}/trajectory_staleness", values)
        metrics |= _stats(f"{prefix}/trajectory_staleness_worst", values)
        metrics |= _stats(f"{prefix}/trajectory_spans", [1.0] * len(values))
    return metrics
