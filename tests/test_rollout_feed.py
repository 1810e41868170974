"""The rollout feeds (`omni_core.trainers.rollout_feed`, `ahead_feed`): what a trainer mode is.

Light: separate_async's `AheadSchedule` over a whole run puts every step's prompt batch once, in step order, never
more than `num_warmup_batches` ahead of training, and tags each with the weights published when it is put, so each
step trains at the staleness the schedule gives (0, 1, 1, 1 for one warm-up batch synced every step, as the flow
run of tests/test_separate_async.py measures it), within warmup + sync - 1 model versions and at verl's span
warmup + 1 at most; a checkpoint between two syncs and a resume from it give the same schedule as an uninterrupted
run.

On the real TransferQueue: an `AheadFeed` writes its queued groups, feeding state and published weights into a
checkpoint; a fresh feed restores them and trains them oldest first, the group past the span bound (verl's unit: steps since
submission) evicted and counted; a sync run refuses that checkpoint.
"""

from __future__ import annotations

import pytest

from omni_core import checkpoint as ckpt
from omni_core.rollout import queue_record
from omni_core.rollout.staleness import span
from omni_core.trainers.ahead_feed import AheadSchedule


def _run(warmup: int, sync: int, total: int, checkpoint_after: int | None = None, tmp_path=None):
    """Drive the schedule as `AheadFeed` does over `total` steps: at each step's start the batches due are put with
    the version published then; after the step the weights are published when due. With `checkpoint_after`, the
    schedule is written into a checkpoint after that step (as `AheadFeed.save`) and a fresh one continues from it
    (as `AheadFeed.restore`: the version the checkpoint names, else the weights published at the epoch's start).
    Returns ({step: the step at whose start its batch was put}, {step: the version its batch names})."""
    schedule = AheadSchedule(warmup, sync, total)
    published, put_at, version = 0, {}, {}
    for step in range(1, total + 1):
        for due in schedule.due(step):
            assert due not in put_at, f"step {due}'s batch put twice"
            put_at[due], version[due] = step, published
        if schedule.publishes_after(step):
            published = step
        if step == checkpoint_after:
            with ckpt.CheckpointWriter(tmp_path, step) as writer:
                writer.write_state(queue_record.RECORD_NAME, schedule.state(schedule.saved_version(step, published)).__dict__)
                folder = writer.commit()
            feed = queue_record.feed_state(folder)
            schedule = AheadSchedule(warmup, sync, total)
            schedule.load(feed)
            published = feed.weights_version
    return put_at, version


@pytest.mark.parametrize("warmup", [0, 1, 2])
@pytest.mark.parametrize("sync", [1, 2, 3])
def test_the_ahead_schedule_puts_each_batch_once_in_order_within_the_staleness_bound(warmup, sync):
    total = 9
    put_at, version = _run(warmup, sync, total)
    assert list(put_at) == list(range(1, total + 1))  # every step's batch, once, in step order
    schedule = AheadSchedule(warmup, sync, total)
    for step in range(1, total + 1):
        # Put at the start of step j = max(1, step - warmup), with the version published after the last multiple of
        # `sync` before j (0: the base weights).
        j = max(1, step - warmup)
        assert put_at[step] == j
        assert version[step] == (j - 1) // sync * sync == schedule.version_of(step)
        assert 0 <= schedule.staleness(step, version[step]) <= warmup + sync - 1
        # verl's span (steps since submission, counting the training step): warmup + 1 once the pipeline is full.
        assert span(step, put_at[step]) == schedule.span(step) == min(step, warmup + 1)


def test_one_warmup_batch_synced_every_step_trains_at_staleness_0_then_1():
    put_at, version = _run(warmup=1, sync=1, total=4)
    schedule = AheadSchedule(1, 1, 4)
    assert [schedule.staleness(step, version[step]) for step in range(1, 5)] == [0.0, 1.0, 1.0, 1.0]
    assert put_at == {1: 1, 2: 1, 3: 2, 4: 3}


@pytest.mark.parametrize("checkpoint_after", [1, 2, 3, 4])
def test_a_checkpoint_between_syncs_resumes_the_same_schedule(checkpoint_after, tmp_path):
    """sync=3: checkpoints after steps 1, 2 and 4 fall between two publications (the record names the version
    published earlier, and its weights); after step 3 the checkpoint's own weights are that version."""
    uninterrupted = _run(warmup=2, sync=3, total=9)
    assert _run(2, 3, 9, checkpoint_after, tmp_path) == uninterrupted


def test_the_staleness_rule_counts_steps_since_submission_as_verls_replay_buffer():
    """verl's ReplayBuffer, written out: drop evicts a finished group when `step - submitted + 1 > threshold`; wait
    holds while a group in flight has `step - submitted + 1 >= threshold`. parameter_sync_step plays no part: at
    verl-omni's defaults (threshold 8, sync every 4 steps) a group submitted at step 1 is evicted at step 9."""
    from omni_core.tq.replay_buffer import StalenessRule

    for step in range(1, 40):
        drop, wait = StalenessRule(8, "drop", step), StalenessRule(8, "wait", step)
        for submitted in range(1, step + 1):
            assert drop.evicts(submitted) == (step - submitted + 1 > 8)
            assert wait.holds(submitted) == (step - submitted + 1 >= 8)
            assert not drop.holds(submitted) and not wait.evicts(submitted)
    assert StalenessRule(8, "drop", 9).evicts(1) and not StalenessRule(8, "drop", 8).evicts(1)
    with pytest.raises(ValueError, match="max_off_policy_threshold=0"):
        StalenessRule(0, "drop", 1)


def test_groups_of_two_batches_that_share_positions_get_advantages_of_their_own():
    """A separate_async batch of train_batch_size=2 can hold step 2's group at position 1 and step 3's at position 1
    (two feeds, both numbered from 0); the advantages group by prompt uid. Hand values: Flow-GRPO's
    A = (R - mean of the uid's group) / (std of the whole batch + 1e-4), std unbiased."""
    import torch

    from omni_core.config import load_config
    from omni_core.tq import client as tqc
    from omni_core.trainers.base import prompt_groups, step_advantages

    uids = ["000002-0001", "000002-0001", "000003-0001", "000003-0001"]  # the same position, two batches
    keys = [tqc.trajectory_key(uid, s) for uid, s in zip(uids, [0, 1, 0, 1], strict=True)]
    assert prompt_groups(keys).tolist() == [0, 0, 1, 1]
    rewards = torch.tensor([1.0, 3.0, 10.0, 14.0])
    algorithm = load_config(overrides=[]).algorithm
    got = step_advantages(algorithm, rewards, torch.zeros(4, dtype=torch.bool), prompt_groups(keys))
    mean = sum(rewards.tolist()) / 4
    std = (sum((r - mean) ** 2 for r in rewards.tolist()) / 3) ** 0.5
    expected = [(1 - 2) / (std + 1e-4), (3 - 2) / (std + 1e-4), (10 - 12) / (std + 1e-4), (14 - 12) / (std + 1e-4)]
    assert got.tolist() == pytest.approx(expected, rel=1e-6)
    # Grouped by position (the request's `prompt_index`) the four samples would be one group: mean 7, not 2 and 12.
    assert got[0].item() == pytest.approx(-1 / (std + 1e-4), rel=1e-6)


def test_a_refill_batch_is_seeded_past_the_positions_of_its_steps_batch():
    """The refill of step s takes positions past the step's own batch (the seed of a sample is derived from the step,
    the position and the sample index), so its noise is new."""
    from omni_core.data.prompts import PromptRecord
    from omni_core.rollout.request import RolloutRequest
    from omni_core.rollout.sampler import derive_sample_seed
    from omni_core.rollout.sampling_params import SamplingParams

    records = [PromptRecord("a", index=0), PromptRecord("b", index=1)]
    params = SamplingParams(n=2, seed=0, height=32, width=32, num_inference_steps=4)
    own = RolloutRequest.of_records("p", 4, params, records, "000004")
    refill = RolloutRequest.of_records("p", 4, params, records, "000004-refill1", first_position=2)
    assert [it.position for it in own.items] == [0, 1] and [it.position for it in refill.items] == [2, 3]
    seeds = lambda r: {derive_sample_seed(0, r.global_step, it.position, k) for it in r.items for k in range(2)}  # noqa: E731
    assert len(seeds(own) | seeds(refill)) == 8


# ---------------------------------------------------------------------------- on the real TransferQueue
ASYNC = [
    "trainer.v1.trainer_mode=separate_async",
    "actor_rollout_ref.rollout.nnodes=1",
    "trainer.v1.separate_async.num_warmup_batches=1",
    "trainer.v1.separate_async.parameter_sync_step=2",
    "trainer.v1.sampler.max_off_policy_threshold=2",
    "trainer.v1.sampler.max_off_policy_strategy=drop",
    "algorithm.rollout_correction.bypass_mode=true",
    "data.train_batch_size=1",
    "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    "trainer.total_training_steps=5",
]


def _trainer(overrides: list[str], run_id: str, tmp_path):
    """A controller of `overrides` with its prompt order and a rollout side of no workers: the groups a checkpoint
    holds are sampled already, and the feed must train them without sampling anything new."""
    from omni_core.agent_loop import AgentLoopManager
    from omni_core.config import load_config
    from omni_core.data.dataloader import PromptDataLoader
    from omni_core.data.prompts import PromptRecord
    from omni_core.records import RunInfo
    from omni_core.trainers import build_diffusion_trainer

    cfg = load_config(overrides=[*overrides, f"trainer.default_local_dir={tmp_path / 'ckpt'}"])
    run = RunInfo(
        run_id=run_id, namespace="omniflow-tests", checkpoint_dir=str(tmp_path / "ckpt"), log_dir=str(tmp_path / "logs")
    )
    trainer = build_diffusion_trainer(cfg, run)
    trainer.dataloader = PromptDataLoader([PromptRecord("a red circle", index=0)], 1, shuffle=False, seed=0)
    trainer.agent_loop = AgentLoopManager([], run.names)
    return trainer


def _queue(partition: str, n: int) -> None:
    """Finished groups sampled ahead: step 2's put at step 1 with the base weights (version 0), steps 4 and 5's put at
    steps 3 and 4 with version 2 (the prompt rows' `global_steps` tag: the step the prompt was submitted at)."""
    import torch

    from omni_core.tq import client as tqc

    groups = {"000002-0000": (1, 0), "000004-0000": (3, 2), "000005-0000": (4, 2)}
    for uid, (step, version) in groups.items():
        tqc.put_prompts(partition, [uid], step, model_version=version)
        tqc.set_prompt_status(partition, [uid], tqc.FINISHED)
        keys = [tqc.trajectory_key(uid, s) for s in range(n)]
        fields = {"rewards": torch.arange(n, dtype=torch.float32) + step}
        tqc.put_trajectories(
            partition, keys, fields, [{"status": tqc.SUCCESS, "global_steps": step, "model_version": version}] * n
        )


@pytest.mark.timeout(300)
def test_the_ahead_feed_checkpoints_its_queue_and_trains_it_oldest_first_within_the_bound(
    transfer_queue, flow_overrides, tmp_path
):
    import ray
    import torch

    from omni_core.tq import client as tqc
    from omni_core.trainers.rollout_feed import SyncFeed

    saving = _trainer([*flow_overrides, *ASYNC], "feed-test", tmp_path)
    partition, n = saving.run.train_partition, saving.config.actor_rollout_ref.rollout.n
    tqc.clear_partition(partition)
    _queue(partition, n)
    prompts_before, trajectories_before = queue_record.queued_rows(partition)
    # After step 3 of a run syncing every 2 steps: requests name version 2 (published after step 2), not the
    # checkpoint's own weights, so the checkpoint carries version 2's weights.
    weights = {"w": torch.randn(3, 2)}
    saving.feed._weights = (ray.put(weights), 2)
    saving.feed.schedule.load(queue_record.FeedState(next_feed=6, weights_version=2, refills=1, groups=0))
    with ckpt.CheckpointWriter(tmp_path / "ckpt", 3) as writer:
        saving.feed.save(writer, 3)
        folder = str(writer.commit())
    assert queue_record.feed_state(folder) == queue_record.FeedState(next_feed=6, weights_version=2, refills=1, groups=3)
    with pytest.raises(ckpt.CheckpointError, match="3 prompt groups"):
        SyncFeed(saving).check_resume(folder)

    tqc.clear_partition(partition)  # an epoch's start clears the partition, then the feed puts its queue back
    resumed = _trainer([*flow_overrides, *ASYNC], "feed-test", tmp_path)
    assert resumed.feed.keeps_queued(folder)
    resumed.feed.restore(folder)
    prompts_after, trajectories_after = queue_record.queued_rows(partition)
    assert {u: (t["status"], t["global_steps"], t["model_version"]) for u, t in prompts_after.items()} == {
        u: (t["status"], t["global_steps"], t["model_version"]) for u, t in prompts_before.items()
    }
    assert trajectories_after.keys() == trajectories_before.keys()
    ref, version = resumed.feed._weights
    assert version == 2 and torch.equal(ray.get(ref)["w"], weights["w"])
    assert (resumed.feed.schedule.next_feed, resumed.feed.schedule.refills) == (6, 1)

    try:
        # Step 4: step 2's group, submitted at step 1, has span 4 - 1 + 1 = 4, past the bound of 2: evicted and counted
        # (verl: `evicted_samples` counts groups); the oldest left is step 4's (span 2, sampled with version 2: 4 - 1 - 2
        # = 1 version stale). Nothing new is put (step 5's batch was put before the checkpoint).
        batch = resumed.feed.sample(4)
        assert batch.prompt_uids == ["000004-0000"] and batch.evicted_spans == [4]
        metrics = resumed.feed.metrics(batch, 4, {})
        assert metrics["training/off_policy/evicted_samples"] == 1.0
        assert metrics["training/off_policy/evicted_samples_staleness/max"] == 4.0
        assert metrics["training/off_policy/trajectory_staleness/mean"] == 1.0
        assert metrics["training/off_policy/trajectory_staleness_worst/max"] == 1.0
        assert metrics["training/off_policy/trajectory_spans/max"] == 1.0
        assert resumed.feed.staleness_of(batch, 4).tolist() == [1.0] * n
        # Step 5: its own group, submitted at step 4: span 2, at the bound, trained; 5 - 1 - 2 = 2 versions stale.
        batch = resumed.feed.sample(5)
        assert batch.prompt_uids == ["000005-0000"] and batch.evicted_spans == []
        assert resumed.feed.metrics(batch, 5, {})["training/off_policy/evicted_samples"] == 0.0
        assert resumed.feed.staleness_of(batch, 5).tolist() == [2.0] * n
        assert resumed.dataloader.state_dict()["position"] == 0  # no prompt was put
    finally:
        tqc.clear_partition(partition)


@pytest.mark.timeout(300)
def test_two_feeds_groups_at_one_position_train_as_two_groups(transfer_queue, flow_overrides, tmp_path):
    """train_batch_size=2, two feeds in flight: step 3's batch (put at step 2) and step 4's (put at step 3) both number
    their prompts from 0, so the groups at position 1 of each carry the same `prompt_index`. The replay buffer hands
    both to step 3 (the oldest ready first, both within the span bound of 2); their advantages are each group's own
    (hand values), where grouping by the stored position would merge them into one group."""
    import torch

    from omni_core.tq import client as tqc
    from omni_core.trainers.base import prompt_groups, step_advantages

    overrides = [*flow_overrides, *ASYNC, "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2"]
    trainer = _trainer(overrides, "two-feeds", tmp_path)
    partition, n = trainer.run.train_partition, trainer.config.actor_rollout_ref.rollout.n
    tqc.clear_partition(partition)
    rewards = {"000003-0001": [1.0, 3.0, 1.0, 3.0], "000004-0001": [10.0, 14.0, 10.0, 14.0]}  # means 2 and 12
    try:
        for submitted, (uid, values) in enumerate(rewards.items(), start=2):
            tqc.put_prompts(partition, [uid], submitted, model_version=submitted - 1)
            tqc.set_prompt_status(partition, [uid], tqc.FINISHED)
            fields = {
                "rewards": torch.tensor(values),
                "failed": torch.zeros(n, dtype=torch.bool),
                "prompt_index": torch.ones(n, dtype=torch.long),  # position 1 in its own request
            }
            tags = [{"status": tqc.SUCCESS, "global_steps": submitted, "model_version": submitted - 1}] * n
            tqc.put_trajectories(partition, [tqc.trajectory_key(uid, s) for s in range(n)], fields, tags)
        trainer.feed.schedule.load(queue_record.FeedState(next_feed=6, weights_version=2, refills=0, groups=0))
        batch = trainer.feed.sample(3)
        assert batch.prompt_uids == list(rewards)
        rows = tqc.get_trajectories(partition, batch.trajectory_keys, select_fields=["rewards", "failed", "prompt_index"])
        assert rows["prompt_index"].tolist() == [1] * (2 * n)  # one group, were it grouped by position
        got = step_advantages(
            trainer.config.algorithm, rows["rewards"].float(), rows["failed"].bool(), prompt_groups(batch.trajectory_keys)
        )
        flat = [r for values in rewards.values() for r in values]
        mean = sum(flat) / len(flat)
        std = (sum((r - mean) ** 2 for r in flat) / (len(flat) - 1)) ** 0.5
        expected = [(r - 2.0) / (std + 1e-4) for r in rewards["000003-0001"]]
        expected += [(r - 12.0) / (std + 1e-4) for r in rewards["000004-0001"]]
        assert got.tolist() == pytest.approx(expected, rel=1e-6)
        by_position = step_advantages(
            trainer.config.algorithm, rows["rewards"].float(), rows["failed"].bool(), rows["prompt_index"]
        )
        assert not torch.allclose(got, by_position)
    finally:
        tqc.clear_partition(partition)
