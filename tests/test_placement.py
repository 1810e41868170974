"""Placement: the run's Ray resource plan, its placement group, what each actor asks Ray for, and where
every module of every policy copy sits (device and dtype).

GPU requests are checked against the session's Ray cluster, which declares 2 logical GPUs on this CPU
machine: the placement-group bundles and each actor's GPU share and assigned GPU id are asserted, not
CUDA work.
"""

from __future__ import annotations

import os

import pytest
import torch

from omni_core.config import load_config, with_updates
from omni_core.models.placement import ROLLOUT_ATTN_BACKENDS, module_placement, rollout_policy_kwargs, training_policy_kwargs
from omni_core.models.policy import FlowPolicy
from omni_core.records import WorkerNames
from omni_core.resources import resource_plan


def _config(**updates):
    return with_updates(load_config(), updates)


@pytest.mark.parametrize(
    ("device", "ranks", "workers", "share"),
    [("cuda", 1, 1, 0.5), ("cuda", 1, 3, 0.25), ("cuda", 2, 2, 0.5), ("cuda", 2, 3, None), ("cpu", 1, 2, 0.0)],
)
def test_resource_plan_colocates_rollout_workers_with_the_training_ranks(device, ranks, workers, share):
    """Separate rollout-worker processes (`hybrid_engine=false`; the hybrid plan is in test_hybrid_engine)."""
    cfg = _config(
        **{
            "trainer.device": device,
            "trainer.n_gpus_per_node": ranks,
            "actor_rollout_ref.rollout.agent.num_workers": workers,
            "actor_rollout_ref.hybrid_engine": False,
        }
    )
    plan = resource_plan(cfg)
    assert len(plan.bundles) == len(plan.training) == ranks
    assert [s.bundle for s in plan.training] == list(range(ranks))
    assert [s.bundle for s in plan.rollout] == [j % ranks for j in range(workers)]
    for b, bundle in enumerate(plan.bundles):
        slots = [s for s in (*plan.training, *plan.rollout) if s.bundle == b]
        assert bundle["CPU"] == sum(s.num_cpus for s in slots)
        if device == "cuda":
            assert bundle["GPU"] == 1.0
            # The processes of a bundle split its GPU equally and never ask for more than it holds.
            assert all(s.num_gpus == pytest.approx(1 / len(slots), abs=1e-4) for s in slots)
            assert sum(s.num_gpus for s in slots) <= 1.0
        else:
            assert "GPU" not in bundle and all(s.num_gpus == 0 for s in slots)
    if share is not None:
        assert {s.num_gpus for s in (*plan.training, *plan.rollout)} == {share}


def test_actors_get_the_gpu_share_and_bundle_the_plan_gives_them(ray_cluster):
    """Two training ranks + two rollout workers on 2 logical GPUs: each rollout worker shares its bundle's GPU
    (Ray gives it the same GPU id as the training rank of that bundle) and sees only that GPU."""
    import ray
    from ray.util.state import list_placement_groups

    from omni_core.distributed.worker_pool import actor_options, create_pool, pool_name, remove_pool

    two = {"trainer.device": "cuda", "trainer.n_gpus_per_node": 2, "actor_rollout_ref.rollout.agent.num_workers": 2}
    cfg = _config(**two, **{"actor_rollout_ref.hybrid_engine": False})
    plan = resource_plan(cfg)
    names = WorkerNames("omniflow-tests", "placement-probe")

    @ray.remote
    class Probe:
        def where(self):
            return ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES")

    pool = create_pool(plan, names)
    try:
        groups = [g for g in list_placement_groups(address=ray_cluster.get_runtime_context().gcs_address, detail=True)]
        (ours,) = [g for g in groups if g.name == pool_name(names) and g.state == "CREATED"]
        assert [b["unit_resources"] for b in ours.bundles] == [{"CPU": 2.0, "GPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}]
        assert ray.util.placement_group_table(pool)["strategy"] == "PACK"
        options = [actor_options(pool, slot, plan) for slot in (*plan.training, *plan.rollout)]
        assert [o["num_gpus"] for o in options] == [0.5, 0.5, 0.5, 0.5]
        probes = [Probe.options(**o).remote() for o in options]
        seen = ray.get([p.where.remote() for p in probes], timeout=120)
        trainers, workers = seen[:2], seen[2:]
        assert sorted(ids[0] for ids, _ in trainers) == [0, 1]  # one GPU per rank
        for (rank_ids, _), (worker_ids, visible) in zip(trainers, workers, strict=True):
            assert worker_ids == rank_ids  # rollout worker j shares the GPU of rank j % ranks
            assert visible == str(worker_ids[0])  # and sees only that GPU (cuda:0 in the actor)
        for p in probes:
            ray.kill(p)
    finally:
        remove_pool(names)


def test_an_unreservable_plan_fails_with_the_bundles_instead_of_hanging(ray_cluster):
    from omni_core.distributed.worker_pool import create_pool

    cfg = _config(**{"trainer.device": "cuda", "trainer.n_gpus_per_node": 3})
    with pytest.raises(RuntimeError, match="could not reserve the run's resources"):
        create_pool(resource_plan(cfg), WorkerNames("omniflow-tests", "placement-too-big"), timeout_s=3)


def test_every_module_of_the_training_copy_sits_on_the_device_in_fp32_master_weights(tiny_sd3_dir, one_torch_thread):
    cfg = _config(
        **{
            "actor_rollout_ref.model.path": str(tiny_sd3_dir),
            "trainer.device": "cpu",
            "actor_rollout_ref.actor.fsdp_config.dtype": "bfloat16",
            "actor_rollout_ref.actor.use_kl_loss": True,
        }
    )
    kwargs = training_policy_kwargs(cfg)
    assert (kwargs["dtype"], kwargs["compute_dtype"], kwargs["device"]) == (torch.float32, torch.bfloat16, torch.device("cpu"))
    policy = FlowPolicy.from_model_config(cfg.actor_rollout_ref.model, **kwargs)
    policy.ensure_reference()
    where = module_placement(policy)
    # Training reads prompt embeddings from the trajectories: no text encoder is loaded at all.
    assert sorted(where) == ["reference", "trained", "transformer", "vae"]
    assert all(w["devices"] == ["cpu"] and w["dtypes"] == ["float32"] for w in where.values())
    assert where["trained"]["trainable_dtypes"] == ["float32"]


def test_a_lora_training_copy_keeps_a_bf16_base_with_fp32_adapters(tiny_sd3_dir, one_torch_thread):
    cfg = _config(
        **{
            "actor_rollout_ref.model.path": str(tiny_sd3_dir),
            "actor_rollout_ref.model.lora_rank": 4,
            "actor_rollout_ref.actor.fsdp_config.model_dtype": "bf16",
            "actor_rollout_ref.actor.fsdp_config.dtype": "bf16",
        }
    )
    policy = FlowPolicy.from_model_config(cfg.actor_rollout_ref.model, **training_policy_kwargs(cfg))
    where = module_placement(policy)
    assert where["trained"]["dtypes"] == ["bfloat16", "float32"]  # frozen base bf16, adapters fp32
    assert where["trained"]["trainable_dtypes"] == ["float32"]
    assert where["vae"]["dtypes"] == ["bfloat16"]


def test_the_rollout_copy_sits_in_rollout_dtype_without_gradients(tiny_sd3_dir, one_torch_thread):
    cfg = _config(**{"actor_rollout_ref.model.path": str(tiny_sd3_dir), "actor_rollout_ref.rollout.dtype": "bfloat16"})
    kwargs = rollout_policy_kwargs(cfg, None)
    assert kwargs["attn_backend"] == ROLLOUT_ATTN_BACKENDS["TORCH_SDPA"] == "native"
    policy = FlowPolicy.from_model_config(cfg.actor_rollout_ref.model, **kwargs)
    where = module_placement(policy)
    assert {"text_encoder", "text_encoder_2", "text_encoder_3"} <= set(where)  # no embedding file: encoders load
    assert all(w["devices"] == ["cpu"] and w["dtypes"] == ["bfloat16"] for w in where.values())
    assert all(w["trainable_dtypes"] == [] for w in where.values())


def test_a_cuda_actor_computes_on_the_gpu_ray_assigned_or_says_it_got_none():
    from omni_core.models.placement import actor_device

    if torch.cuda.is_available():  # a CUDA machine: index 0 of what Ray made visible
        assert actor_device("cuda") == torch.device("cuda", 0)
        return
    with pytest.raises(RuntimeError, match="the Ray actor got no GPU"):
        actor_device("cuda")
