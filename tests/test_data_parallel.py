"""Data-parallel training ranks (issue 12): `actor.strategy=ddp` with `trainer.n_gpus_per_node` ranks in one gloo
group on CPU. Two ranks must take the same optimizer steps as one rank on the same global batch, every rank
must see an on-policy ratio of exactly 1, and runs of several ranks must survive a killed rank.
"""

from __future__ import annotations

import pytest
import torch
from flow_utils import TWO_FSDP2_RANKS

from omni_core.config import load_config
from omni_core.models.placement import rollout_policy_kwargs
from omni_core.models.policy import FlowPolicy
from omni_core.rollout.sampler import generate
from omni_core.rollout.sampling_params import SamplingParams
from omni_core.workers.training_actor import TrainingActor
from omni_core.workers.training_ranks import TrainingRanks, merge_rank_metrics

pytestmark = pytest.mark.timeout(600)

# Two prompts x 4 samples in one shuffled mini-batch: each rank trains a random half of it, in two
# micro-batches of 2 (gradient accumulation on each rank, then DDP's average).
DP_CONFIG = [
    "trainer.device=cpu",
    "data.train_batch_size=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.shuffle=true",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.pipeline.height=32",
    "actor_rollout_ref.rollout.pipeline.width=32",
    "actor_rollout_ref.rollout.pipeline.num_inference_steps=4",
    "actor_rollout_ref.rollout.algo.sde_window_range=[0,3]",
]
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.5, -0.5])
# The bound of ||w_2ranks - w_1rank|| / ||w_1rank|| per tensor after two steps. Measured: 8.8e-8 (max abs
# difference 4e-8): fp32 rounding of DDP's average of two rank gradients vs one rank's accumulation of four
# micro-batches. Single elements differ by up to ~1e-5 relative where AdamW normalises a near-zero gradient.
RELATIVE_BOUND = 1e-6
# LoRA (fsdp2): the adapters' norms are small, so the same rounding is a larger share of them. Measured 8.9e-7.
RELATIVE_BOUND_LORA = 2e-6


def _trajectory(cfg, weights):
    rollout = FlowPolicy.from_model_config(cfg.actor_rollout_ref.model, **rollout_policy_kwargs(cfg, None))
    rollout.load_trainable_state(weights)
    params = SamplingParams.for_training(cfg.actor_rollout_ref.rollout)
    return generate(rollout, ["a red circle", "a blue square"], prompt_indices=[0, 1], **params.generate_kwargs(1))


@pytest.mark.parametrize(("strategy", "lora"), [("ddp", False), ("fsdp2", False), ("fsdp2", True)])
def test_two_ranks_take_the_one_rank_step_and_every_ratio_is_one(ray_cluster, tiny_sd3_dir, one_torch_thread, strategy, lora):
    """ddp: whole parameters on each rank, gradients all-reduced. fsdp2: each rank holds half of every tensor
    (fully_shard per block), gradients reduce-scattered; the weights are gathered to compare. With LoRA (rank 4)
    the frozen base is sharded too and the adapter is what is trained and gathered."""
    import ray

    model = f"actor_rollout_ref.model.path={tiny_sd3_dir}"
    if lora:
        model = [model, "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"]
    model = model if isinstance(model, list) else [model]
    one = load_config(overrides=[*DP_CONFIG, *model])
    two = load_config(overrides=[*DP_CONFIG, *model, "trainer.n_gpus_per_node=2", f"actor_rollout_ref.actor.strategy={strategy}"])
    single = TrainingActor(one.model_dump(mode="json"), total_training_steps=2, num_threads=1)
    before = {k: v.clone() for k, v in single.get_weights().items()}
    traj = _trajectory(one, before)

    remote = ray.remote(num_cpus=0)(TrainingActor)
    ranks = TrainingRanks([remote.remote(two.model_dump(mode="json"), 2, 1, rank=r, world_size=2) for r in range(2)], strategy)
    try:
        assert ranks.form_group(300) and not ranks.form_group(300)  # formed once, then kept
        for step in (1, 2):  # two training steps (two optimizer steps: AdamW's state carries over)
            needed = ray.get([h.local_samples.remote(traj.batch_size, step) for h in ranks.handles])
            assert sorted(needed[0] + needed[1]) == list(range(8)), needed  # disjoint halves of the batch
            per_rank = ray.get(
                [
                    h.train_on.remote(traj.index_select(torch.tensor(n)), ADVANTAGES, step, samples=n)
                    for h, n in zip(ranks.handles, needed, strict=True)
                ]
            )
            expected = single.train_on(traj, ADVANTAGES, step)
            for metrics in per_rank:  # old log-probs recomputed as the first forward sees them: on-policy exactly
                assert metrics["actor/ratio_mean"] == 1.0 and metrics["actor/ratio_std"] == 0.0, metrics
            merged = merge_rank_metrics(per_rank)
            assert merged["actor/grad_norm"] == pytest.approx(expected["actor/grad_norm"], rel=1e-5)
            assert merged["actor/pg_loss"] == pytest.approx(expected["actor/pg_loss"], rel=1e-4, abs=1e-9)

        if strategy == "ddp":  # every rank holds the whole weights, bit-identical
            weights = ray.get([h.get_weights.remote() for h in ranks.handles])
            assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
        else:  # the shards, gathered onto rank 0
            sizes = ray.get(ranks.handles[1].local_parameter_elements.remote())
            assert 0 < sizes["local"] < sizes["global"], sizes  # rank 1 holds a part of the parameters
        gathered = ray.get(ranks.weights_ref(300))
        after = single.get_weights()
        assert gathered.keys() == after.keys()
        worst, largest_abs = 0.0, 0.0
        for name, w1 in after.items():
            diff = gathered[name] - w1
            worst = max(worst, float(diff.norm() / w1.norm()))
            largest_abs = max(largest_abs, float(diff.abs().max()))
            # The two updates moved each trained tensor by far more than they differ (buffers such as pos_embed stay).
            moved = float((w1 - before[name]).norm())
            assert moved > 100 * float(diff.norm()) or moved == float(diff.norm()) == 0.0, name
        print(
            f"{strategy}{' LoRA' if lora else ''}: two ranks vs one rank after 2 steps: relative difference {worst:.3e} (norm per tensor), max abs {largest_abs:.3e}"
        )
        assert worst <= (RELATIVE_BOUND_LORA if lora else RELATIVE_BOUND)
    finally:
        ranks.kill()


def test_a_two_rank_flow_run_trains_what_one_rank_trains(two_rank_reference, flow_reference):
    """The flow with two ranks: both actors ran in the run's placement group, and after its two steps the
    weights are the one-rank run's within the bound above (the rollouts are the same: same seeds)."""
    from flow_utils import final_weights

    state, ckpt = two_rank_reference
    result = state.result()
    assert result.global_step == 2
    two, one = final_weights(ckpt), final_weights(flow_reference[2])
    assert two.keys() == one.keys()
    worst = max(float((two[k] - one[k]).norm() / one[k].norm()) for k in one)
    print(f"two-rank vs one-rank flow run: relative difference {worst:.3e}")
    assert worst <= RELATIVE_BOUND
    # Rank 0 wrote the checkpoint once: one actor folder, no per-rank copies.
    assert sorted(p.name for p in (ckpt / "global_step_2").iterdir() if p.is_dir()) == ["actor"]


def test_a_rank_killed_mid_step_is_restarted_and_the_run_ends_with_the_fault_free_weights(
    two_rank_reference, flow_overrides, tmp_path
):
    """SIGKILL training rank 1 of two fsdp2 ranks (pid from Ray's state API) while it runs epoch 2's training step,
    rank 0 waiting for it in a collective (fsdp2's all-gather of parameters, reduce-scatter of gradients): the step
    fails on both ranks, Ray restarts rank 1, the retried epoch resets both to the epoch's checkpoint (its shards)
    and forms the ranks' group again, and the run ends with the uninterrupted two-rank run's weights, bit for bit."""
    import ray
    from flow_utils import assert_same_weights, final_weights, run_with_kill
    from ray.util.state import list_actors, list_tasks

    ckpt = tmp_path / "ckpt"
    overrides = [*flow_overrides, *TWO_FSDP2_RANKS]
    state, killed = run_with_kill(overrides, ckpt, "rankkill", "training-actor-rank1", "TrainingActor", "train_step")
    assert killed, "training rank 1 was not seen running a training step"
    assert state.is_completed(), state.message
    assert_same_weights(final_weights(ckpt), final_weights(two_rank_reference[1]))
    run_id = state.result().run_id
    address = ray.get_runtime_context().gcs_address
    (rank1,) = list_actors(address=address, filters=[("name", "=", f"omniflow-{run_id}-training-actor-rank1")], detail=True)
    assert rank1.num_restarts == 1, rank1
    # Step 2 ran twice on each rank: the first try failed (rank 1 killed in it, rank 0's collective broken).
    (rank0,) = list_actors(address=address, filters=[("name", "=", f"omniflow-{run_id}-training-actor")], detail=True)
    for actor in (rank0, rank1):
        steps = list_tasks(
            address=address, filters=[("actor_id", "=", actor.actor_id), ("name", "=", "TrainingActor.train_step")]
        )
        assert sorted(t.state for t in steps) == ["FAILED", "FINISHED", "FINISHED"], (actor.name, steps)


def test_fsdp2_checkpoints_hold_shards_and_a_whole_model_and_resume_on_another_rank_count(
    flow_reference, two_rank_reference, flow_overrides, tmp_path
):
    """The two-rank fsdp2 run's epoch-1 checkpoint (conftest.two_rank_reference): `actor/dcp/` holds one shard file
    per rank (torch.distributed.checkpoint), rank 0 also wrote the consolidated `model.safetensors` and a diffusers
    export that plain `from_pretrained` loads. One fsdp2 rank resumes from those shards (`resume_mode=resume_path`,
    resharded from two ranks to one) and ends with the one-rank run's weights within the bound above. (Two ranks
    loading the shards and ending bit for bit on the uninterrupted run: the rank-kill test above, whose retried
    epoch forms the group again from that checkpoint.)"""
    from diffusers import SD3Transformer2DModel
    from flow_utils import final_weights
    from omniflow.flows.main_diffusion_v1 import main_diffusion_v1
    from safetensors.torch import load_file

    epoch_1 = two_rank_reference[1] / "global_step_1"
    actor = epoch_1 / "actor"
    shards = sorted(p.name for p in (actor / "dcp").iterdir())
    assert ".metadata" in shards and len([s for s in shards if s.endswith(".distcp")]) == 2, shards
    whole = load_file(str(actor / "model.safetensors"))
    exported = SD3Transformer2DModel.from_pretrained(str(actor / "hf")).state_dict()
    assert whole.keys() == exported.keys() and all(torch.equal(whole[k], exported[k]) for k in whole)

    resharded = tmp_path / "resharded"
    overrides = [
        *flow_overrides,
        "actor_rollout_ref.actor.strategy=fsdp2",
        "trainer.n_gpus_per_node=1",
        f"trainer.default_local_dir={resharded}",
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={epoch_1}",
    ]
    state = main_diffusion_v1(overrides=overrides, return_state=True)
    assert state.is_completed(), state.message
    assert state.result().global_step == 2
    assert sorted(p.name for p in resharded.glob("global_step_*")) == ["global_step_2"]  # it trained epoch 2 only
    one_rank, resumed = final_weights(flow_reference[2]), final_weights(resharded)
    worst = max(float((resumed[k] - one_rank[k]).norm() / one_rank[k].norm()) for k in one_rank)
    print(f"fsdp2 (2 ranks, then 1 resumed) vs one-rank run: relative difference {worst:.3e}")
    assert worst <= RELATIVE_BOUND
