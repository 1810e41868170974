"""Shared pytest set-up: offline, telemetry off, deterministic threads."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")


# ----------------------------------------------------------------------------- Ray + TransferQueue
# One local Ray cluster per test session (DESIGN.md section 7): 16 logical CPUs on 2 cores, because
# TransferQueue's controller and storage units, the training actor and each rollout worker reserve one.
import pytest  # noqa: E402

RAY_TEST_NAMESPACE = "omniflow-tests"


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=16, include_dashboard=False, namespace=RAY_TEST_NAMESPACE, log_to_driver=True)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def transfer_queue(ray_cluster):
    """The real TransferQueue (controller + 2 SimpleStorage units), once per session."""
    import transfer_queue as tq
    from omegaconf import OmegaConf

    tq.init(OmegaConf.create({"backend": {"storage_backend": "SimpleStorage", "SimpleStorage": {"num_data_storage_units": 2, "total_storage_size": 100000}}}))
    yield tq
    tq.close()


# ----------------------------------------------------------------------------- tiny diffusers models
# Built once per session with save_pretrained and loaded back by the tests through load_pipeline /
# FlowPolicy, the production path (STYLE.md 12). ~0.5 s each on 2 cores.
@pytest.fixture(scope="session")
def tiny_sd3_dir(tmp_path_factory):
    from omni_core.models.tiny import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("tiny_sd3"), arch="sd3", seed=0)


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory):
    from omni_core.models.tiny import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("tiny_flux"), arch="flux", seed=0)


@pytest.fixture
def one_torch_thread():
    """Tiny-model tests run on one thread (other processes share the 2 cores); restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
