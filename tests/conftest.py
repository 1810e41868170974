"""Shared pytest set-up: offline, telemetry off, deterministic threads, Prefect files in a temp dir."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

# Prefect's files of this session (result storage, memo store, profiles) go to a temporary PREFECT_HOME
# that is removed at the end, never to ~/.prefect. Prefect reads its settings when first imported, and
# pytest imports this file before any test module (which import prefect), so setting them here is in time;
# Ray workers and the subprocesses of the tests inherit them.
if "prefect" in sys.modules:
    raise RuntimeError("prefect was imported before tests/conftest.py could give the session its own PREFECT_HOME")
PREFECT_TEST_HOME = tempfile.mkdtemp(prefix="omniflow-tests-prefect-home-")
os.environ["PREFECT_HOME"] = PREFECT_TEST_HOME
os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = os.path.join(PREFECT_TEST_HOME, "storage")
# The embedded API's template database (flows/embedded_api.py) stays in this session's folder too; every test
# server on a new home after the first starts from it.
os.environ["OMNIFLOW_CACHE_DIR"] = os.path.join(PREFECT_TEST_HOME, "omniflow-cache")


def pytest_unconfigure(config) -> None:
    shutil.rmtree(PREFECT_TEST_HOME, ignore_errors=True)


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")
# The wandb and mlflow trackers never reach a server from the tests, in Ray workers too (which keep the environment
# the session's cluster started with, so a test's monkeypatch cannot reach them): wandb offline, its own files in
# this session's folder; mlflow in its default store, the run's checkpoint folder.
os.environ["WANDB_MODE"] = "offline"
for _name, _sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
    os.environ[_name] = os.path.join(PREFECT_TEST_HOME, "wandb", _sub)
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"  # mlflow reads DO_NOT_TRACK only as "true", not "1"
# Prefect's console log handlers write to the process's stderr (fd 2, which pytest captures), never to the sys.stderr of
# the moment they were configured: configured while a test's capsys stream was sys.stderr, they kept that stream after
# pytest closed it, and every later Prefect log line of the process failed ("I/O operation on closed file"), taking its
# flow runs down (seen under pytest-xdist, where such a test ran first in its process).
for _handler in ("CONSOLE", "DEBUG"):
    os.environ[f"PREFECT_LOGGING_HANDLERS_{_handler}_STREAM"] = "ext://sys.__stderr__"


# ----------------------------------------------------------------------------- Ray + TransferQueue
# One local Ray cluster per test session (docs/design.md section 7): 16 logical CPUs on 2 cores, because
# TransferQueue's controller and storage units, the training actor and each rollout worker reserve one.
import pytest  # noqa: E402

RAY_TEST_NAMESPACE = "omniflow-tests"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """`make test` runs the suite in two pytest-xdist processes (`--dist loadgroup`), each with its own Ray cluster and
    Prefect API: a module's tests stay in one process (its module fixtures are built once), and modules that share a
    session run of their own (`xdist_group` in the module: `mid_epoch_reference`, `separate_workers_run`) stay
    together so that run is made once.

    xdist's own order (most tests first) is kept: handing the groups out longest first put the heaviest runs side
    by side (each starts Ray workers and subprocesses on the same 2 cores) and made the suite longer on CI
    (1,234 s against 1,003 s), though it left neither process idle at the end."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    for item in items:
        heavy = {item.module.__name__, f"{item.module.__name__}::{getattr(item, 'originalname', item.name)}"} & HEAVY_MODULES
        if not heavy and not set(getattr(item, "fixturenames", ())) & HEAVY_FIXTURES:
            item.add_marker(pytest.mark.light)


# The groups that run flows, Ray clusters or Prefect servers, with the seconds each took in `make test` on 2 cores
# (setup, call and teardown, from a `-v` run's report times, 2026-12-05): where to look first to trim the suite.
HEAVY_GROUPS = {
    "test_concurrency_and_cancellation": 256,
    "separate_workers_run": 228,
    "test_deployments": 211,
    "test_separate_async": 164,
    "mid_epoch_reference": 149,
    "test_data_parallel": 145,
    "test_api_faults": 111,
    "test_procedural_pipeline": 82,
    "test_multinode": 79,
    "test_learning": 63,
    "test_torch_compile": 57,
    "test_tracking": 42,
    "test_security": 42,
    "test_tq": 29,
    "test_events_alerts": 26,
    "test_live_logs": 26,
    "test_ray_observability": 24,
    "test_hybrid_engine": 23,
    "test_main_flow": 23,
    "test_precision": 22,
    "test_group_refill": 22,
    "test_pipeline": 20,
    "test_embedded_api": 19,
    "test_reward_server": 18,
    "test_reward_faults": 16,
    "test_library_use": 15,
    "test_ray_job": 70,
    "test_policy_family_flows": 97,  # alone, 2026-12-06
}


# ----------------------------------------------------------------------------- light tests
# `make test-light` (`-m light`): the tests that start no Ray cluster, Prefect server or subprocess, under 3 minutes
# alone. A test is light unless it needs one of HEAVY_FIXTURES (directly or through another fixture) or it or its
# module is in HEAVY_MODULES (`module` or `module::test`: tests that start a process themselves); `_LightGuard`
# fails a light test that starts one anyway, so a test that grows heavy leaves the light set by its failure, not
# by a reader's memory.
HEAVY_FIXTURES = {"ray_cluster", "transfer_queue", "prefect_api", "chromium"}
HEAVY_MODULES = {name for name in HEAVY_GROUPS if name.startswith("test_")} | {
    "test_cli_runs",
    "test_checkpoint_faults",
    "test_process_faults",
    "test_cli",  # runs `omniflow` commands in a subprocess
    "test_validation_groups",  # imports in a fresh interpreter, to see what validation pulls in
    "test_cluster_examples",
    "test_ray_start",  # starts Ray in a subprocess and stops its raylet
    "test_containers",
    "test_gpu_smoke::test_without_cuda_exits_2_with_the_message",  # runs benchmarks/gpu_smoke.py in a subprocess
    "test_gpu_smoke::test_cpu_check_runs_every_phase_and_writes_finite_json",
    "test_checkpoint::test_runlock_refuses_live_holder_and_takes_over_after_it_dies",
    "test_checkpoint::test_runlock_takes_over_lock_of_finished_pid",
    "test_prompt_embeddings::test_the_cache_key_of_a_cached_run_needs_no_diffusers",
    "test_training_actor::test_make_tiny_model_cli_writes_a_pipeline_diffusers_loads",
    # mlflow's first import in a process runs `uname -p` (platform.processor()).
    "test_export_handoff::test_a_run_that_tracked_with_mlflow_gets_its_export_registered",
}


class _LightGuard:
    """Process starts (audit events of subprocess, fork and spawn) seen while a light test's fixtures and body run."""

    EVENTS = ("subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system", "os.exec")
    active, ray_before = False, False
    seen: list[str] = []

    @classmethod
    def audit(cls, event: str, args: tuple) -> None:
        if cls.active and event in cls.EVENTS:
            cls.seen.append(f"{event} {str(args[0])[:120] if args else ''}")


sys.addaudithook(_LightGuard.audit)


def _ray_initialized() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    light = item.get_closest_marker("light") is not None
    _LightGuard.active, _LightGuard.seen, _LightGuard.ray_before = light, [], _ray_initialized()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    if _LightGuard.active:
        _LightGuard.active = False
        started = list(_LightGuard.seen) + (["ray.init"] if _ray_initialized() and not _LightGuard.ray_before else [])
        if started:
            pytest.fail(f"a light test started a process: {started}; add its module to HEAVY_MODULES in tests/conftest.py")
    return result


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from omni_core.distributed.ray_cluster import NO_PRESTARTED_WORKERS

    if not ray.is_initialized():
        # The dashboard runs so that Ray's state API (actor and task names) can be checked. Two logical GPUs
        # let the placement tests check GPU requests and placement-group bundles on this CPU machine. No idle
        # workers started ahead, as in a run's own cluster (an idle cluster: 4.8 CPU-s a minute with them, 3.3 without
        # them and without metrics collection).
        ray.init(
            num_cpus=16,
            num_gpus=2,
            include_dashboard=True,
            namespace=RAY_TEST_NAMESPACE,
            log_to_driver=True,
            _system_config=dict(NO_PRESTARTED_WORKERS),
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def transfer_queue(ray_cluster):
    """The real TransferQueue (controller + 2 SimpleStorage units), once per session."""
    import transfer_queue as tq
    from omegaconf import OmegaConf

    tq.init(
        OmegaConf.create(
            {
                "backend": {
                    "storage_backend": "SimpleStorage",
                    "SimpleStorage": {"num_data_storage_units": 2, "total_storage_size": 100000},
                }
            }
        )
    )
    yield tq
    tq.close()


# ----------------------------------------------------------------------------- tiny diffusers models
# Built once per session with save_pretrained and loaded back by the tests through load_pipeline /
# FlowPolicy, the production path (tiny real models, loaded the production way). ~0.5 s each on 2 cores.
@pytest.fixture(scope="session")
def tiny_sd3_dir(tmp_path_factory):
    from omni_core.models.tiny import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("tiny_sd3"), arch="sd3", seed=0)


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory):
    from omni_core.models.tiny import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("tiny_flux"), arch="flux", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen_image_dir(tmp_path_factory):
    from omni_core.models.tiny import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("tiny_qwen_image"), arch="qwen-image", seed=0)


@pytest.fixture
def one_torch_thread():
    """Tiny-model tests run on one thread (other processes share the 2 cores); restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------------------------ Prefect + flows
@pytest.fixture(scope="session")
def prefect_api():
    """One Prefect test harness (embedded SQLite API) per session; yields its API URL."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield PREFECT_API_URL.value()


@pytest.fixture(scope="session")
def flow_prompts(tmp_path_factory):
    """Two training prompts (one step per epoch at train_batch_size=2) and one validation prompt."""
    d = tmp_path_factory.mktemp("prompts")
    (d / "train.txt").write_text("a red circle\na blue square\n")
    (d / "val.txt").write_text("a green dot\n")
    return d


@pytest.fixture(scope="session")
def flow_overrides(tiny_sd3_dir, flow_prompts) -> list[str]:
    """A lean main-job config for tests: 2 epochs x 1 step of 2 prompts x 4 samples, 32 px, 4 steps, cosine lr."""
    return [
        f"actor_rollout_ref.model.path={tiny_sd3_dir}",
        f"data.train_files={flow_prompts / 'train.txt'}",
        f"data.val_files={flow_prompts / 'val.txt'}",
        "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.pipeline.height=32",
        "actor_rollout_ref.rollout.pipeline.width=32",
        "actor_rollout_ref.rollout.pipeline.num_inference_steps=4",
        "actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps=4",
        "actor_rollout_ref.rollout.algo.sde_window_range=[0,3]",
        "trainer.total_epochs=2",
        # A schedule whose lr differs at every step, so that each run compared with another (resumed, retried, killed)
        # also compares the LR scheduler's restored state: a resume with a fresh scheduler runs its next step at lr x 1
        # instead of x 0.5 (2 steps: x 1, then 0.5 * (1 + cos(pi / 2)) = x 0.5). Not a warm-up: its first step runs at
        # lr 0 (HF / verl convention), so a one-step run of this config would not train at all.
        "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
        "trainer.logger=[console,file]",
        # No GPU slot: the session's Prefect test harness runs no lease-expiry service, so a slot held by a run that a
        # test SIGKILLs would never come back and the resumed run would wait for it forever. The concurrency tests
        # (test_concurrency_and_cancellation) name their own limit on a real server.
        "trainer.concurrency.gpu_limit=null",
    ]


@pytest.fixture(scope="session")
def flow_reference(prefect_api, ray_cluster, transfer_queue, flow_overrides, tmp_path_factory):
    """The uninterrupted in-process run of the lean config: (final state, TrainResult, checkpoint dir).

    Every other run of that config (resumed, retried, another process) must end with its weights.
    """
    from omniflow.flows.main_diffusion_v1 import main_diffusion_v1

    ckpt = tmp_path_factory.mktemp("reference") / "ckpt"
    state = main_diffusion_v1(overrides=[*flow_overrides, f"trainer.default_local_dir={ckpt}"], return_state=True)
    assert state.is_completed(), state.message
    return state, state.result(), ckpt


@pytest.fixture(scope="session")
def separate_workers_run(prefect_api, ray_cluster, transfer_queue, flow_overrides, tmp_path_factory):
    """One run of the lean config with two rollout workers of their own (`rollout.agent.num_workers=2`: no hybrid
    engine), EMA on and validation after every step, whose rollout worker 0 is SIGKILLed once step 1 is saved, and
    the zero-std filter on (the jpeg reward never ties, so it keeps every group):
    (final state, checkpoint dir, [killed pid]). One run serves the rollout-worker, EMA, worker-kill and filter tests
    (test_rollout_workers, test_ema_kl_cfg, test_process_faults): none of them may change the trained weights, which
    must end as `flow_reference`'s."""
    from flow_utils import run_with_kill

    ckpt = tmp_path_factory.mktemp("separate_workers") / "ckpt"
    overrides = [
        *flow_overrides,
        "actor_rollout_ref.rollout.agent.num_workers=2",
        "actor_rollout_ref.actor.ema.enable=true",
        "trainer.test_freq=1",
        "algorithm.filter_zero_std_groups=true",
    ]
    state, killed = run_with_kill(overrides, ckpt, "separate", "rollout-worker-0", "RolloutWorker")
    return state, ckpt, killed


@pytest.fixture(scope="session")
def two_rank_reference(prefect_api, ray_cluster, transfer_queue, flow_overrides, tmp_path_factory):
    """The uninterrupted in-process run of the lean config on two fsdp2 ranks: (final state, checkpoint dir). It serves
    test_data_parallel's flow tests: two ranks against one, a rank killed mid-step, and the fsdp2 checkpoints' resume
    (its uninterrupted run). ddp's flow runs are the mid-epoch ones (flow_utils.MID_EPOCH)."""
    from flow_utils import TWO_FSDP2_RANKS
    from omniflow.flows.main_diffusion_v1 import main_diffusion_v1

    ckpt = tmp_path_factory.mktemp("two_ranks") / "ckpt"
    overrides = [*flow_overrides, *TWO_FSDP2_RANKS, f"trainer.default_local_dir={ckpt}"]
    state = main_diffusion_v1(overrides=overrides, return_state=True)
    assert state.is_completed(), state.message
    return state, ckpt


# ------------------------------------------------------------------------------------ the UI, in a browser
@pytest.fixture(scope="module")
def chromium() -> tuple[str, str]:
    """Debian's chromium + chromedriver, installed with apt if missing (bounded by browser.INSTALL_BOUND_S,
    outside the test's own timeout: the test is marked func_only)."""
    from browser import ensure_chromium

    found = ensure_chromium()
    if isinstance(found, str):  # CI (root, Debian, apt) installs them: not having them is a failure, not a skip
        pytest.fail(found)
    return found


@pytest.fixture(scope="module")
def browser(chromium):
    from browser import chrome

    driver = chrome(*chromium)
    yield driver
    driver.quit()
