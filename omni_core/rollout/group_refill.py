"""`trainer.v1.sampler.drop_incomplete_groups` (sync mode): a prompt group with a failed sample is evicted, its
prompt is sampled again, and the step trains complete groups only.

verl-omni's diffusion replay buffer evicts a group with a failed sample (its
prompt and trajectory rows cleared from the TransferQueue) and submits as many replacement prompts, up to
`max_incomplete_group_refill_rounds` rounds; its generation batch is one prompt. OmniFlow follows it with
two differences, both from issue 13:

- the replacement is the failed group's own prompt, under a new uid `<uid>-refill<round>`, sampled afresh:
  its samples are seeded as prompt position `position + round x <prompts of the step>` (never a position of
  the step's other prompts), so a failure that depends on the noise (a non-finite image, a reward that
  rejects some images) is not replayed bit for bit, and the run stays deterministic;
- a prompt still failing after the last round is dropped (counted, with the reason of every try) instead of
  failing the run, and the step trains on the complete groups left when the PPO mini-batches still divide
  them (`check_trainable`, the rule of `omni_core.algorithms.update._check_sizes`); otherwise
  `IncompleteGroupsError` names the keys.

A failed group is one the rollout tagged `failure`: a sample whose reward failed (row field `failed`) or a
generation that failed (no rows). Plain code: the rollout and the row clearing come in as callables.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

from omni_core.rollout.request import RolloutItem, RolloutRequest
from omni_core.tq.client import uid_of_key
from omni_core.tq.replay_buffer import SampledBatch

__all__ = [
    "IncompleteGroupsError",
    "RefillStats",
    "RefilledBatch",
    "check_trainable",
    "describe_reasons",
    "group_refill_metrics",
    "sample_complete_groups",
]

METRIC_PREFIX = "training/rollout_failure"


class IncompleteGroupsError(RuntimeError):
    """Prompt groups kept failing through every refill round and the complete groups left cannot form the PPO
    mini-batches: nothing of the step is trained. A data or reward error that a retry would repeat."""


@dataclass(frozen=True)
class RefillStats:
    """One step's evictions and refills; `metrics()` gives verl-omni's names (plus `dropped_groups`)."""

    evicted_groups: int = 0  # groups cleared because a sample failed (a prompt failing twice counts twice)
    evicted_trajectories: int = 0  # their trajectory rows (a failed generation has none)
    refilled_prompts: int = 0  # prompts sampled again, over all rounds
    refill_rounds: int = 0  # rounds run (0: nothing failed)
    dropped_groups: int = 0  # prompts still failing after the last round: not trained this step

    def metrics(self) -> dict[str, float]:
        return {f"{METRIC_PREFIX}/{name}": float(value) for name, value in asdict(self).items()}


@dataclass(frozen=True)
class RefilledBatch(SampledBatch):
    """A step's complete groups after refills (`failed_uids` is always empty) and what it took to get them."""

    refill: RefillStats = field(default_factory=RefillStats)
    dropped: dict[str, tuple[str, ...]] = field(default_factory=dict)  # uid of a dropped prompt -> reason of each try


def describe_reasons(reasons: Sequence[str]) -> str:
    """The failure reasons of a prompt's tries, each once, in order, with its count when it repeats."""
    counts = Counter(reasons)
    return " | ".join(f"{why} (x{counts[why]})" if counts[why] > 1 else why for why in counts)


def group_refill_metrics(batch: SampledBatch) -> dict[str, float]:
    """The refill metrics of a step's batch; {} when `drop_incomplete_groups` is off (a plain `SampledBatch`)."""
    return batch.refill.metrics() if isinstance(batch, RefilledBatch) else {}


def _refill_request(request: RolloutRequest, failed: Sequence[RolloutItem], round_: int) -> RolloutRequest:
    """The failed prompts again, under new uids and with new sample seeds (their positions move past the step's)."""
    shift = round_ * len(request.items)
    items = tuple(RolloutItem(f"{it.uid}-refill{round_}", it.position + shift, it.record) for it in failed)
    return replace(request, items=items)


def sample_complete_groups(
    request: RolloutRequest,
    rollout: Callable[[RolloutRequest], SampledBatch],
    clear_rows: Callable[[list[str]], None],
    max_rounds: int,
) -> RefilledBatch:
    """Roll out `request`, evict every failed group (`clear_rows` of its trajectory keys; `rollout` has cleared
    the prompt rows), and roll out the failed prompts again, up to `max_rounds` times.

    Args:
        request: the step's prompts.
        rollout: puts a request, dispatches it and waits for all its groups, failed ones included.
        clear_rows: removes TransferQueue rows of the step's partition.
        max_rounds: `trainer.v1.sampler.max_incomplete_group_refill_rounds` (>= 1).

    Returns the complete groups (oldest-first order of the step's uids; keys sorted), with the counts and, per
    prompt dropped after the last round, the reason of each of its tries.
    """
    if max_rounds < 1:
        raise ValueError(f"max_incomplete_group_refill_rounds={max_rounds} must be a positive integer")
    original: dict[str, RolloutItem] = {it.uid: it for it in request.items}  # uid in flight -> the step's item
    kept_uids: list[str] = []
    kept_keys: list[str] = []
    reasons: dict[str, list[str]] = {}
    evicted_groups = evicted_trajectories = refilled = rounds = 0
    pending = request
    while True:
        batch = rollout(pending)
        keys_of: dict[str, list[str]] = {}
        for key in batch.trajectory_keys:
            keys_of.setdefault(uid_of_key(key), []).append(key)
        failed: list[RolloutItem] = []
        for uid in batch.prompt_uids:
            keys = keys_of.get(uid, [])
            if uid in batch.failed_uids:
                clear_rows(keys)
                evicted_groups, evicted_trajectories = evicted_groups + 1, evicted_trajectories + len(keys)
                item = original[uid]
                reasons.setdefault(item.uid, []).append(batch.failed_uids[uid])
                failed.append(item)
            else:
                kept_uids.append(uid)
                kept_keys.extend(keys)
        if not failed or rounds == max_rounds:
            break
        rounds += 1
        pending = _refill_request(request, failed, rounds)
        original.update({it.uid: original_item for it, original_item in zip(pending.items, failed, strict=True)})
        refilled += len(failed)
    stats = RefillStats(evicted_groups, evicted_trajectories, refilled, rounds, dropped_groups=len(failed))
    return RefilledBatch(
        prompt_uids=sorted(kept_uids),
        trajectory_keys=sorted(kept_keys),
        refill=stats,
        dropped={it.uid: tuple(reasons[it.uid]) for it in failed},
    )


def check_trainable(batch: RefilledBatch, group_size: int, ppo_mini_batch_size: int, max_rounds: int, step: int) -> None:
    """Raise `IncompleteGroupsError` when the complete groups left after drops cannot be trained: none left, or a
    number the PPO mini-batches (`ppo_mini_batch_size` groups of `group_size` samples) do not divide."""
    groups = len(batch.prompt_uids)
    if not batch.dropped or (groups and groups % ppo_mini_batch_size == 0):
        return
    dropped = "; ".join(f"{uid}: {describe_reasons(why)}" for uid, why in sorted(batch.dropped.items()))
    left = (
        "no complete group is left"
        if not groups
        else f"the {groups} complete groups left ({groups * group_size} samples) do not divide into PPO mini-batches of "
        f"actor_rollout_ref.actor.ppo_mini_batch_size={ppo_mini_batch_size} prompts"
    )
    raise IncompleteGroupsError(
        f"step {step}: {len(batch.dropped)} prompt group(s) still failed after "
        f"trainer.v1.sampler.max_incomplete_group_refill_rounds={max_rounds} refills and were dropped ({dropped}); {left}, "
        f"so the step cannot train and no update was applied. Fix the reward or rollout failure named there, raise "
        f"max_incomplete_group_refill_rounds, set actor_rollout_ref.actor.ppo_mini_batch_size=1 so that any number of "
        f"complete groups trains, or set trainer.v1.sampler.drop_incomplete_groups=false (failed samples then get "
        f"advantage 0, bounded by reward.max_failure_ratio)"
    )
