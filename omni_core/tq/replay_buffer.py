"""The v1 trainer's replay buffer: hands out complete prompt groups from a TransferQueue partition.

Follows the idea of verl's v1 ``ReplayBuffer`` (``verl/trainer/ppo/v1/replay_buffer.py``, used unchanged by
verl-omni; reference/verl-omni.md §6.3): the trainer never talks to rollout workers, it reads prompt-row
tags from TQ until enough groups are done, takes the oldest, and clears their prompt rows. Failed groups
are handed out too (partial groups, as in verl), with their failure reason.

What differs: every wait is bounded (DESIGN.md §7). Each poll calls the trainer's ``liveness_check``
(which raises when a rollout worker died), and after ``timeout_s`` a ``TimeoutError`` says what was
ready and what to check; verl's loop polls forever once a worker is gone. A group is ``finished`` only
when its ``group_size`` trajectory rows are also there, so a status written before the data is not
read as a complete group. Staleness dropping (``max_off_policy_threshold``) is not implemented yet.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omni_core.tq.client import FAILURE, FINISHED, PENDING, RUNNING, clear, list_rows, uid_of_key

logger = logging.getLogger(__name__)

# How often a long wait says so in the log.
_LOG_EVERY_S = 30.0


@dataclass(frozen=True)
class SampledBatch:
    """One training batch of prompt groups, as TQ keys (read the data with ``get_trajectories``)."""

    prompt_uids: list[str]  # oldest first: (global_steps tag, uid)
    trajectory_keys: list[str]  # every trajectory row of those groups, sorted
    failed_uids: dict[str, str] = field(default_factory=dict)  # uid -> reason, for groups whose rollout failed


@dataclass(frozen=True)
class _GroupCensus:
    """The prompt groups of a partition at one poll."""

    ready: list[tuple[int, str]]  # (global_steps, uid) of finished-and-complete or failed groups
    trajectories: dict[str, list[str]]  # uid -> its trajectory keys
    failed: dict[str, str]  # uid -> reason
    incomplete: int  # finished, but fewer than group_size trajectory rows so far
    pending: int
    running: int

    def describe(self) -> str:
        return (
            f"{len(self.ready)} ready ({len(self.failed)} failed), {self.incomplete} finished but missing "
            f"trajectory rows, {self.pending} pending, {self.running} running"
        )


def _census(rows: dict[str, dict[str, Any]], group_size: int) -> _GroupCensus:
    trajectories: dict[str, list[str]] = defaultdict(list)
    prompts: dict[str, dict[str, Any]] = {}
    for key, tag in rows.items():
        if tag.get("is_prompt"):
            prompts[key] = tag
        else:
            trajectories[uid_of_key(key)].append(key)
    ready, failed, counts = [], {}, {"incomplete": 0, PENDING: 0, RUNNING: 0}
    for uid, tag in prompts.items():
        status, step = tag.get("status"), int(tag.get("global_steps", 0))
        if status == FAILURE:
            ready.append((step, uid))
            failed[uid] = str(tag.get("reason", "unknown"))
        elif status == FINISHED:
            if len(trajectories.get(uid, ())) >= group_size:
                ready.append((step, uid))
            else:
                counts["incomplete"] += 1
        elif status in (PENDING, RUNNING):
            counts[status] += 1
    return _GroupCensus(
        ready=sorted(ready),
        trajectories=dict(trajectories),
        failed=failed,
        incomplete=counts["incomplete"],
        pending=counts[PENDING],
        running=counts[RUNNING],
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

    def sample(self, batch_size: int, global_step: int, group_size: int) -> SampledBatch:
        """Wait until ``batch_size`` prompt groups are finished (with ``group_size`` trajectory rows each) or
        failed; take the oldest (by global_steps, then uid), clear their prompt rows, return their keys.

        Raises whatever ``liveness_check`` raises, or TimeoutError after ``timeout_s``.
        ``global_step`` is the trainer's current step (for messages now, staleness checks later).
        """
        if batch_size <= 0 or group_size <= 0:
            raise ValueError(f"batch_size={batch_size} and group_size={group_size} must be > 0")
        start = last_log = time.monotonic()
        while True:
            if self.liveness_check is not None:
                self.liveness_check()
            census = _census(list_rows(self.partition), group_size)
            if len(census.ready) >= batch_size:
                return self._take(census, batch_size)
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

    def _take(self, census: _GroupCensus, batch_size: int) -> SampledBatch:
        picked = [uid for _, uid in census.ready[:batch_size]]
        # Only the prompt rows: the trainer clears trajectory rows once the step is done with them.
        clear(self.partition, picked)
        keys = sorted(k for uid in picked for k in census.trajectories.get(uid, ()))
        failed = {uid: census.failed[uid] for uid in picked if uid in census.failed}
        return SampledBatch(prompt_uids=picked, trajectory_keys=keys, failed_uids=failed)
