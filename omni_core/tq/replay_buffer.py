"""The v1 trainer's replay buffer: hands out complete prompt groups from a TransferQueue partition.

Follows the idea of verl's v1 ``ReplayBuffer`` (``verl/trainer/ppo/v1/replay_buffer.py``, used unchanged by
verl-omni): the trainer never talks to rollout workers, it reads prompt-row
tags from TQ until enough groups are done, takes the oldest, and clears their prompt rows. Failed groups
are handed out too (partial groups, as in verl), with their failure reason.

What differs: every wait is bounded (docs/design.md section 7). Each poll calls the trainer's ``liveness_check``
(which raises when a rollout worker died), and after ``timeout_s`` a ``TimeoutError`` says what was
ready and what to check; verl's loop polls forever once a worker is gone. A group is ``finished`` only
when its ``group_size`` trajectory rows are also there, so a status written before the data is not
read as a complete group.

Staleness (separate_async, ``StalenessRule``), in verl's unit: a group's span is the global steps since its prompt
was submitted (the prompt row's ``global_steps`` tag), counting the training step (``omni_core.rollout.staleness``).
With ``drop`` a finished group whose span passes ``trainer.v1.sampler.max_off_policy_threshold`` is cleared and
counted instead of trained; with ``wait`` sampling also holds while a group in flight has reached the threshold,
so that it is trained now rather than dropped later (verl's ReplayBuffer rules). A group's version (the weights
its trajectories were sampled with, their ``model_version`` tags) gives the staleness metrics.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omni_core.rollout.staleness import span
from omni_core.tq.client import FAILURE, FINISHED, PENDING, RUNNING, clear, list_rows, uid_of_key

OFF_POLICY_STRATEGIES = ("drop", "wait")

logger = logging.getLogger(__name__)

# How often a long wait says so in the log.
_LOG_EVERY_S = 30.0


@dataclass(frozen=True)
class SampledBatch:
    """One training batch of prompt groups, as TQ keys (read the data with ``get_trajectories``)."""

    prompt_uids: list[str]  # oldest first: (global_steps tag, uid)
    trajectory_keys: list[str]  # every trajectory row of those groups, sorted
    failed_uids: dict[str, str] = field(default_factory=dict)  # uid -> reason, for groups whose rollout failed
    versions: dict[str, int] = field(default_factory=dict)  # uid -> weight version of its trajectories (when tagged)
    evicted_spans: list[int] = field(default_factory=list)  # the span of each over-stale group cleared (StalenessRule)


def merge_batches(batches: list[SampledBatch]) -> SampledBatch:
    """One global step's batches of several local updates as one: prompts and trajectory keys in update order (each
    update's keys sorted, as it trained them), failures, versions and evicted spans together."""
    return SampledBatch(
        prompt_uids=[uid for b in batches for uid in b.prompt_uids],
        trajectory_keys=[key for b in batches for key in b.trajectory_keys],
        failed_uids={uid: reason for b in batches for uid, reason in b.failed_uids.items()},
        versions={uid: version for b in batches for uid, version in b.versions.items()},
        evicted_spans=[span for b in batches for span in b.evicted_spans],
    )


@dataclass(frozen=True)
class StalenessRule:
    """separate_async's off-policy bound at training step ``step``, as verl's ReplayBuffer applies it: ``threshold``
    (``max_off_policy_threshold``) on the span ``step - submitted + 1`` of a group submitted at step ``submitted``."""

    threshold: int
    strategy: str  # "drop" | "wait"
    step: int

    def __post_init__(self) -> None:
        if self.strategy not in OFF_POLICY_STRATEGIES:
            raise ValueError(f"max_off_policy_strategy={self.strategy!r} must be one of {OFF_POLICY_STRATEGIES}")
        if self.threshold < 1:
            raise ValueError(f"max_off_policy_threshold={self.threshold} must be >= 1")

    def span(self, submitted: int) -> int:
        return span(self.step, submitted)

    def evicts(self, submitted: int) -> bool:
        """A finished group past the threshold: cleared instead of trained (``drop``)."""
        return self.strategy == "drop" and self.span(submitted) > self.threshold

    def holds(self, submitted: int) -> bool:
        """A group in flight that has reached the threshold: sampling waits for it (``wait``)."""
        return self.strategy == "wait" and self.span(submitted) >= self.threshold


@dataclass(frozen=True)
class _GroupCensus:
    """The prompt groups of a partition at one poll."""

    ready: list[tuple[int, str]]  # (global_steps, uid) of finished-and-complete or failed groups
    trajectories: dict[str, list[str]]  # uid -> its trajectory keys
    failed: dict[str, str]  # uid -> reason
    incomplete: int  # finished, but fewer than group_size trajectory rows so far
    pending: int
    running: int
    versions: dict[str, int] = field(default_factory=dict)  # uid -> weight version (trajectories' tags, else the prompt's)
    in_flight: list[str] = field(default_factory=list)  # uids pending, running, or finished with rows missing
    submitted: dict[str, int] = field(default_factory=dict)  # uid -> the global step its prompt was put at

    def describe(self) -> str:
        return (
            f"{len(self.ready)} ready ({len(self.failed)} failed), {self.incomplete} finished but missing "
            f"trajectory rows, {self.pending} pending, {self.running} running"
        )


def _census(rows: dict[str, dict[str, Any]], group_size: int) -> _GroupCensus:
    trajectories: dict[str, list[str]] = defaultdict(list)
    prompts: dict[str, dict[str, Any]] = {}
    sampled_with: dict[str, int] = {}
    for key, tag in rows.items():
        if tag.get("is_prompt"):
            prompts[key] = tag
        else:
            uid = uid_of_key(key)
            trajectories[uid].append(key)
            if "model_version" in tag:
                sampled_with[uid] = min(int(tag["model_version"]), sampled_with.get(uid, int(tag["model_version"])))
    ready, failed, counts = [], {}, {"incomplete": 0, PENDING: 0, RUNNING: 0}
    versions: dict[str, int] = {}
    in_flight: list[str] = []
    submitted: dict[str, int] = {}
    for uid, tag in prompts.items():
        status, step = tag.get("status"), int(tag.get("global_steps", 0))
        submitted[uid] = step
        if uid in sampled_with:
            versions[uid] = sampled_with[uid]
        elif "model_version" in tag:
            versions[uid] = int(tag["model_version"])
        if status == FAILURE:
            ready.append((step, uid))
            failed[uid] = str(tag.get("reason", "unknown"))
        elif status == FINISHED:
            if len(trajectories.get(uid, ())) >= group_size:
                ready.append((step, uid))
            else:
                counts["incomplete"] += 1
                in_flight.append(uid)
        elif status in (PENDING, RUNNING):
            counts[status] += 1
            in_flight.append(uid)
    return _GroupCensus(
        ready=sorted(ready),
        trajectories=dict(trajectories),
        failed=failed,
        incomplete=counts["incomplete"],
        pending=counts[PENDING],
        running=counts[RUNNING],
        versions=versions,
        in_flight=in_flight,
        submitted=submitted,
    )


class ReplayBuffer:
    """Waits for and hands out complete prompt groups of one TQ partition (``"<run_id>/train"``)."""

    def __init__(
        self,
        partition: str,
        *,
        poll_interval: float = 0.2,
        timeout_s: float = 600.0,
        liveness_check: Callable[[], None] | None = None,
    ) -> None:
        if poll_interval <= 0 or timeout_s <= 0:
            raise ValueError(f"poll_interval={poll_interval} and timeout_s={timeout_s} must be > 0")
        self.partition = partition
        self.poll_interval = poll_interval
        self.timeout_s = timeout_s
        self.liveness_check = liveness_check

    def sample(
        self,
        batch_size: int,
        global_step: int,
        group_size: int,
        staleness_rule: StalenessRule | None = None,
        refill: Callable[[int], None] | None = None,
    ) -> SampledBatch:
        """Wait until ``batch_size`` prompt groups are finished (with ``group_size`` trajectory rows each) or
        failed; take the oldest (by global_steps, then uid), clear their prompt rows, return their keys.

        ``staleness_rule`` (separate_async): over-stale finished groups are cleared and counted, never returned;
        with ``wait``, sampling also holds while a group in flight has reached the threshold.
        ``refill(missing)`` is called when dropped groups left fewer groups than ``batch_size`` finished or in
        flight (the trainer puts more prompts).

        Raises whatever ``liveness_check`` raises, or TimeoutError after ``timeout_s``.
        ``global_step`` is the trainer's current step (for messages).
        """
        if batch_size <= 0 or group_size <= 0:
            raise ValueError(f"batch_size={batch_size} and group_size={group_size} must be > 0")
        start = last_log = time.monotonic()
        evicted: list[int] = []
        while True:
            if self.liveness_check is not None:
                self.liveness_check()
            census = _census(list_rows(self.partition), group_size)
            holding = False
            if staleness_rule is not None:
                rule = staleness_rule
                stale = [uid for step, uid in census.ready if uid not in census.failed and rule.evicts(step)]
                if stale:
                    evicted += [rule.span(census.submitted[uid]) for uid in stale]
                    clear(self.partition, [*stale, *(k for uid in stale for k in census.trajectories.get(uid, ()))])
                    logger.info("ReplayBuffer(%s) step %d dropped %d over-stale groups", self.partition, global_step, len(stale))
                    census = _census(list_rows(self.partition), group_size)
                holding = any(rule.holds(census.submitted[uid]) for uid in census.in_flight)
                short = batch_size - len(census.ready) - len(census.in_flight)
                if short > 0 and refill is not None:
                    refill(short)
                    continue
            if len(census.ready) >= batch_size and not holding:
                return self._take(census, batch_size, evicted)
            now = time.monotonic()
            if now - start >= self.timeout_s:
                raise TimeoutError(
                    f"ReplayBuffer({self.partition!r}) waited {self.timeout_s:g}s at global step {global_step} for "
                    f"{batch_size} complete prompt groups of {group_size}: {census.describe()}. Check that the "
                    f"rollout workers are alive and writing to this partition (their logs), that this step's "
                    f"prompts were put, and that each finished group wrote {group_size} trajectories "
                    f"(actor_rollout_ref.rollout.n); a slow rollout needs a larger timeout."
                )
            if now - last_log >= _LOG_EVERY_S:
                logger.info(
                    "ReplayBuffer(%s) step %d waiting %.0fs: %s", self.partition, global_step, now - start, census.describe()
                )
                last_log = now
            time.sleep(self.poll_interval)

    def _take(self, census: _GroupCensus, batch_size: int, evicted: list[int] | None = None) -> SampledBatch:
        picked = [uid for _, uid in census.ready[:batch_size]]
        # Only the prompt rows: the trainer clears trajectory rows once the step is done with them.
        clear(self.partition, picked)
        keys = sorted(k for uid in picked for k in census.trajectories.get(uid, ()))
        failed = {uid: census.failed[uid] for uid in picked if uid in census.failed}
        versions = {uid: census.versions[uid] for uid in picked if uid in census.versions}
        return SampledBatch(
            prompt_uids=picked,
            trajectory_keys=keys,
            failed_uids=failed,
            versions=versions,
            evicted_spans=list(evicted or ()),
        )
