"""Which GPU slots a run holds (`omni_core.resources.gpu_slot_request`, `trainer.concurrency`): one per GPU of the run,
of a limit per host or per joined Ray cluster by default, none for a run on no GPU. The served runs that wait for
them are in tests/test_concurrency_and_cancellation.py."""

from __future__ import annotations

from omni_core.config import load_config
from omni_core.resources import GpuSlotRequest, gpu_limit_name, gpu_slot_request


def test_a_cpu_run_takes_no_slot_of_the_default_limit():
    cfg = load_config(overrides=["trainer.device=cpu"])
    assert cfg.trainer.concurrency.gpu_limit == "auto"
    assert gpu_slot_request(cfg, "host-a", cluster_gpus=8) is None


def test_a_gpu_run_holds_one_slot_per_gpu_of_its_hosts_limit():
    sync = load_config(overrides=["trainer.device=cuda", "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.strategy=ddp"])
    assert gpu_slot_request(sync, "host-a", cluster_gpus=8) == GpuSlotRequest("omniflow-gpu-host-a", occupy=2, size=8)
    # separate_async: the training rank's GPU and each standalone rollout worker's
    overrides = [
        "trainer.device=cuda",
        "trainer.v1.trainer_mode=separate_async",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=2",
    ]
    separate = load_config(overrides=overrides)
    assert gpu_slot_request(separate, "host-a", cluster_gpus=4) == GpuSlotRequest("omniflow-gpu-host-a", occupy=3, size=4)
    # another host (or a joined cluster, by its GCS address) is another limit: its runs never wait for these
    assert gpu_slot_request(separate, "10.0.0.5:6379", cluster_gpus=4).limit == "omniflow-gpu-10.0.0.5:6379"
    # a new limit is never smaller than one run's need; gpu_limit_size sets it
    assert gpu_slot_request(sync, "host-a", cluster_gpus=0).size == 2
    sized = load_config(overrides=["trainer.device=cuda", "trainer.concurrency.gpu_limit_size=4"])
    assert gpu_slot_request(sized, "host-a", cluster_gpus=8).size == 4


def test_a_named_limit_is_shared_and_taken_by_cpu_runs_too_and_null_takes_none():
    named = load_config(overrides=["trainer.device=cpu", "trainer.concurrency.gpu_limit=team-gpus"])
    assert gpu_slot_request(named, "host-a", cluster_gpus=0) == GpuSlotRequest("team-gpus", occupy=1, size=1)
    off = load_config(overrides=["trainer.device=cuda", "trainer.concurrency.gpu_limit=null"])
    assert gpu_slot_request(off, "host-a", cluster_gpus=8) is None
    # the pipeline's evaluation uses one GPU whatever the run's ranks
    cuda = load_config(overrides=["trainer.device=cuda", "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.strategy=ddp"])
    assert gpu_slot_request(cuda, "host-a", cluster_gpus=8, gpus=1).occupy == 1


def test_a_limit_name_never_holds_a_character_prefect_refuses():
    assert gpu_limit_name("rack 3/node&7") == "omniflow-gpu-rack-3-node-7"


def test_a_limit_smaller_than_the_run_needs_is_refused_with_the_command_that_raises_it():
    import pytest

    from omni_core.config import ConfigError
    from omni_core.resources import check_gpu_limit_size

    request = GpuSlotRequest("omniflow-gpu-host-a", occupy=3, size=8)
    check_gpu_limit_size(request, 3, "the run")  # exactly enough
    with pytest.raises(ConfigError) as err:
        check_gpu_limit_size(request, 2, "the run")
    assert err.value.keys == ["trainer.concurrency.gpu_limit"]
    assert "needs 3 slots" in str(err.value) and "prefect gcl update omniflow-gpu-host-a --limit 3" in str(err.value)
