"""The rollout queue in a checkpoint (`omni_core.rollout.queue_record`) on the real TransferQueue.

Groups put ahead of training, finished or failed, are written into a checkpoint and put back into an empty
partition: the same prompt rows (status, step, version), the same trajectory rows, field for field; trained
groups (their prompt rows already cleared) are left out; groups still in flight are refused; the published
weights round-trip when saved.
"""

from __future__ import annotations

import pytest
import torch


def _fill(partition: str) -> None:
    from omni_core.tq import client as tqc

    # Group a: finished, sampled with version 2 for step 4. Group b: a reward failure for step 5. Group c: trained.
    tqc.put_prompts(partition, ["000004-0000", "000005-0000", "000003-0000"], 4, model_version=2)
    tqc.set_prompt_status(partition, ["000004-0000", "000003-0000"], tqc.FINISHED)
    tqc.set_prompt_status(partition, ["000005-0000"], tqc.FAILURE, "reward timed out")
    keys = [tqc.trajectory_key(uid, s) for uid in ("000004-0000", "000005-0000", "000003-0000") for s in range(2)]
    fields = {
        "latents": torch.arange(6 * 3, dtype=torch.float32).reshape(6, 3),
        "rewards": torch.tensor([0.1, 0.2, 0.0, 0.0, 0.5, 0.6]),
        "data_source": ["ocr", "ocr", "geneval", "geneval", "ocr", "ocr"],
    }
    tags = [{"status": tqc.SUCCESS, "global_steps": 4, "model_version": 2} for _ in keys]
    tqc.put_trajectories(partition, keys, fields, tags)
    tqc.clear(partition, ["000003-0000"])  # group c was handed out: only its trajectory rows are left


def test_queued_groups_round_trip_through_a_checkpoint(transfer_queue, tmp_path):
    from omni_core import checkpoint as ckpt
    from omni_core.rollout import queue_record
    from omni_core.tq import client as tqc

    partition = "queue-record-test/train"
    tqc.clear_partition(partition)
    _fill(partition)
    prompts_before, trajectories_before = queue_record.queued_rows(partition)
    assert sorted(prompts_before) == ["000004-0000", "000005-0000"]
    assert len(trajectories_before) == 4
    fields_before = tqc.get_trajectories(partition, sorted(trajectories_before))

    weights = {"w": torch.randn(3, 2), "b": torch.zeros(2)}
    feed = queue_record.FeedState(next_feed=6, weights_version=2, refills=1, groups=0)
    with ckpt.CheckpointWriter(tmp_path, 5) as writer:
        saved = queue_record.save(writer, partition, feed, weights)
        folder = writer.commit()
    assert saved.groups == 2

    tqc.clear_partition(partition)
    assert queue_record.restore(folder, partition) == 2
    prompts_after, trajectories_after = queue_record.queued_rows(partition)
    for uid, tag in prompts_before.items():
        for key in ("status", "global_steps", "model_version", "reason"):
            assert prompts_after[uid].get(key) == tag.get(key), (uid, key)
    assert prompts_after["000005-0000"]["reason"] == "reward timed out"
    assert trajectories_after.keys() == trajectories_before.keys()
    fields_after = tqc.get_trajectories(partition, sorted(trajectories_after))
    assert torch.equal(fields_after["latents"], fields_before["latents"])
    assert torch.equal(fields_after["rewards"], fields_before["rewards"])
    assert fields_after["data_source"] == fields_before["data_source"] == ["ocr", "ocr", "geneval", "geneval"]

    assert queue_record.feed_state(folder) == queue_record.FeedState(next_feed=6, weights_version=2, refills=1, groups=2)
    back = queue_record.saved_weights(folder)
    assert back is not None and all(torch.equal(back[k], weights[k]) for k in weights)
    ckpt.verify_checkpoint(folder)  # the record is in the manifest like every other file
    tqc.clear_partition(partition)


def test_a_group_in_flight_is_refused_and_a_sync_checkpoint_has_no_record(transfer_queue, tmp_path):
    from omni_core import checkpoint as ckpt
    from omni_core.rollout import queue_record
    from omni_core.tq import client as tqc

    partition = "queue-record-inflight/train"
    tqc.clear_partition(partition)
    tqc.put_prompts(partition, ["000002-0000"], 2, model_version=1)  # pending
    feed = queue_record.FeedState(next_feed=3, weights_version=1, refills=0, groups=0)
    with pytest.raises(RuntimeError, match="1 groups in flight"), ckpt.CheckpointWriter(tmp_path, 1) as writer:
        queue_record.save(writer, partition, feed, None)
    assert not list(tmp_path.glob("global_step_*"))  # nothing committed
    assert queue_record.feed_state(None) is None and queue_record.feed_state(tmp_path) is None
    tqc.clear_partition(partition)
