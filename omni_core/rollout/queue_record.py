"""The rollout queue in a checkpoint: separate_async's prompt groups sampled ahead and not trained yet.

A separate_async checkpoint is written once no request is in flight (the controller lets the queued and running
requests finish first: they are the groups of the next `num_warmup_batches` steps, which training waits for
anyway), so what is queued at that moment is a set of finished (or failed) prompt groups in the run's
TransferQueue partition. This module writes them next to the weights and puts them back into the partition
when a run resumes (or an epoch starts or is retried) from that checkpoint:

* ``rollout_queue.pt``: every queued prompt row's tag (status, the step it was put for, its weight version)
  and the trajectory rows of those groups, fields and tags, as ``get_trajectories`` reads them;
* ``rollout_queue.json``: the feeding state (the next step to put a batch for, the weight version later
  requests name) and the group count;
* ``rollout_weights.safetensors``: the weights that version names when it is not the checkpoint's own
  (`parameter_sync_step` > 1 and a checkpoint between two syncs; LoRA: the adapter only).

The dataloader state of such a checkpoint is past the queued prompts, so they are trained exactly once: from
the record by a separate_async run, never by a sync run (which refuses the checkpoint instead of skipping them).

Why not TransferQueue's own ``save_checkpoint`` / ``load_checkpoint`` (installed 0.1.11 has them): they
snapshot and restore the whole controller, every partition of every run on the cluster (one named controller
serves them all, docs/design.md section 2), and a load replaces all partitions, so resuming one run would roll the others
back. This record holds one run's partition only.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_core import checkpoint as ckpt
from omni_core.tq import client as tqc

RECORD_NAME = "rollout_queue"  # .pt (rows) and .json (feeding state)
WEIGHTS_NAME = "rollout_weights"  # .safetensors


@dataclass(frozen=True)
class FeedState:
    """Where the controller's feeding continues after a checkpoint."""

    next_feed: int  # the step whose prompt batch is put next
    weights_version: int  # the version requests put from now on name
    refills: int  # refill batches put so far (their uids stay unique)
    groups: int  # prompt groups in the record


def queued_rows(partition: str) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """(prompt uid -> tag, trajectory key -> tag) of the groups queued in `partition`: those whose prompt row is
    still there (a trained group's prompt row is cleared when the replay buffer hands it out)."""
    rows = tqc.list_rows(partition)
    prompts = {key: tag for key, tag in rows.items() if tag.get("is_prompt")}
    trajectories = {key: tag for key, tag in rows.items() if not tag.get("is_prompt") and tqc.uid_of_key(key) in prompts}
    return prompts, trajectories


def save(writer: ckpt.CheckpointWriter, partition: str, feed: FeedState, weights: dict[str, Any] | None) -> FeedState:
    """Write the queued groups of `partition` (nothing may be in flight) and the feeding state into `writer`'s
    checkpoint; `weights` (or None when the version is the checkpoint's own) are the ones `feed` names."""
    prompts, trajectories = queued_rows(partition)
    in_flight = sorted(uid for uid, tag in prompts.items() if tag.get("status") in (tqc.PENDING, tqc.RUNNING))
    if in_flight:
        raise RuntimeError(f"rollout queue of {partition} saved with {len(in_flight)} groups in flight: {in_flight[:3]}")
    keys = sorted(trajectories)
    fields = tqc.get_trajectories(partition, keys) if keys else {}
    writer.write_torch_state(RECORD_NAME, {"prompts": prompts, "trajectory_tags": trajectories, "fields": fields})
    feed = FeedState(feed.next_feed, feed.weights_version, feed.refills, groups=len(prompts))
    writer.write_state(RECORD_NAME, feed.__dict__)
    if weights is not None:
        writer.write_tensors(WEIGHTS_NAME, weights)
    return feed


def feed_state(checkpoint: str | Path | None) -> FeedState | None:
    """The feeding state of a separate_async checkpoint (None: a fresh start or a sync checkpoint)."""
    if checkpoint is None or not (Path(checkpoint) / f"{RECORD_NAME}.json").is_file():
        return None
    return FeedState(**ckpt.read_state(checkpoint, RECORD_NAME))


def saved_weights(checkpoint: str | Path) -> dict[str, Any] | None:
    """The weights the feeding state names, when the checkpoint holds them (else: its own weights)."""
    path = Path(checkpoint) / f"{WEIGHTS_NAME}.safetensors"
    return ckpt.read_tensors(checkpoint, WEIGHTS_NAME) if path.is_file() else None


def restore(checkpoint: str | Path, partition: str) -> int:
    """Put the checkpoint's queued groups back into `partition` (trajectory rows first, then the prompt rows with
    their status, step and version tags); returns the number of groups."""
    record = ckpt.read_torch_state(checkpoint, RECORD_NAME)
    prompts: dict[str, dict[str, Any]] = record["prompts"]
    tags: dict[str, dict[str, Any]] = record["trajectory_tags"]
    if tags:
        keys = sorted(tags)
        tqc.put_trajectories(partition, keys, record["fields"], [tags[k] for k in keys])
    by_tag: dict[tuple[int, int | None, str, str | None], list[str]] = defaultdict(list)
    for uid, tag in prompts.items():
        version = tag.get("model_version")
        by_tag[(int(tag["global_steps"]), None if version is None else int(version), tag["status"], tag.get("reason"))].append(
            uid
        )
    for (step, version, status, reason), uids in by_tag.items():
        tqc.put_prompts(partition, sorted(uids), step, model_version=version)
        tqc.set_prompt_status(partition, sorted(uids), status, reason)
    return len(prompts)
