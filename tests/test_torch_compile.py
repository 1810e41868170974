"""torch.compile of the transformer as config switches (issue 14): `actor_rollout_ref.actor.use_torch_compile` (the
training ranks: old log-probs, update, reference) and `actor_rollout_ref.rollout.use_torch_compile` (the rollout
workers, forward only).

Compiling is slow on 2 cores (a cold Inductor compile of the tiny transformer's forward: 25-50 s; forward + backward
about twice that), so this module makes one Inductor compile: the rollout worker's forward at the tiniest shapes
(32 px, 2 denoising steps, 2 samples), shared by its tests through a module fixture. The training actor's switch is
checked with torch.compile's `aot_eager` backend (Dynamo captures the same graphs and AOTAutograd builds the same
forward / backward split; only Inductor's kernel generation is left out): what it shows is that the key routes the
old log-prob, update and reference forwards through compiled graphs. Inductor's own numbers for training (first
on-policy ratio, log-prob drift, speed) are in benchmarks/bench_compile.py.
"""

from __future__ import annotations

import uuid

import pytest
import torch
from torch._dynamo.eval_frame import OptimizedModule

from omni_core.config import ConfigError, load_config
from omni_core.data.prompts import PromptRecord
from omni_core.rollout.request import RolloutRequest
from omni_core.rollout.sampler import generate
from omni_core.rollout.sampling_params import SamplingParams
from omni_core.tq import client as tqc
from omni_core.validation import config_problems
from omni_core.workers.rollout_worker import RolloutWorker
from omni_core.workers.training_actor import TrainingActor

pytestmark = pytest.mark.timeout(600)

CPU_ONLY = {"cuda": 0, "npu": 0, "cpu": 2}
# The tiniest run: 1 prompt x 2 samples, 32 px, 2 denoising steps with a window of 1, one micro-batch of 2.
TINY = [
    "trainer.device=cpu",
    "data.train_batch_size=1",
    "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.rollout.pipeline.height=32",
    "actor_rollout_ref.rollout.pipeline.width=32",
    "actor_rollout_ref.rollout.pipeline.num_inference_steps=2",
    "actor_rollout_ref.rollout.algo.sde_window_size=1",
    "actor_rollout_ref.rollout.algo.sde_window_range=[0,1]",
    "actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps=2",
]
# Compiled vs eager velocity, fp32: Inductor fuses and reorders reductions (layer norms, softmax, matmul epilogues),
# which changes results by a few ulps per op (fp32 eps 1.2e-7) and through the transformer's 4 blocks by more.
# Measured: 9.5e-7 at a largest |velocity| of 2.2 (4.4e-7 of it). The bound, 2e-5 of the largest |velocity|, is ~45x
# that, and ~100x below what stale weights give (the 1% weight change below moves the velocity by more than 2e-3).
RELATIVE_TOLERANCE = 2e-5


def _velocity_inputs(policy, batch: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    generators = [torch.Generator().manual_seed(i) for i in range(batch)]
    latents = policy.prepare_latents(batch, 32, 32, generators)
    cond = policy.encode_prompts(["a red circle"], max_sequence_length=32)
    return latents, torch.tensor([900.0, 400.0])[:batch], {k: v.expand(batch, *v.shape[1:]) for k, v in cond.items()}


def _velocity(policy, compiled: bool, inputs) -> torch.Tensor:
    before, policy.torch_compile = policy.torch_compile, compiled
    try:
        with torch.no_grad():
            return policy.velocity(*inputs)
    finally:
        policy.torch_compile = before


@pytest.fixture(scope="module")
def compiled_worker(tiny_sd3_dir, transfer_queue):
    """A rollout worker built as the agent loop builds it, with the rollout switch on, after its first forward
    (the module's one Inductor compile); yields (worker, its velocity inputs, torch.compile counters before)."""
    config = load_config(
        overrides=[*TINY, f"actor_rollout_ref.model.path={tiny_sd3_dir}", "actor_rollout_ref.rollout.use_torch_compile=true"]
    )
    before_threads = torch.get_num_threads()
    worker = RolloutWorker(config.model_dump(mode="json"), worker_index=0, num_threads=1)
    inputs = _velocity_inputs(worker.policy, batch=2)
    counters_before = worker.torch_compile_stats()
    _velocity(worker.policy, True, inputs)
    yield worker, inputs, counters_before
    torch.set_num_threads(before_threads)


def test_the_rollout_switch_compiles_the_workers_forward(compiled_worker):
    worker, inputs, before = compiled_worker
    assert worker.policy.torch_compile
    assert isinstance(worker.policy.compiled_modules()["trained"], OptimizedModule)
    after = worker.torch_compile_stats()
    assert after["frames_compiled"] > before["frames_compiled"] and after["graphs"] > before["graphs"], (before, after)
    assert after["graph_breaks"] == before["graph_breaks"]  # the whole forward is one graph


def test_compiled_velocities_match_eager_and_follow_pushed_weights_without_a_recompile(compiled_worker):
    worker, inputs, _ = compiled_worker
    eager, compiled = _velocity(worker.policy, False, inputs), _velocity(worker.policy, True, inputs)
    scale = eager.abs().max().item()
    assert (compiled - eager).abs().max().item() <= RELATIVE_TOLERANCE * scale
    # A weight push (sync mode: after every step) copies into the same parameters, which the graph takes as inputs.
    graphs = worker.torch_compile_stats()["graphs"]
    pushed = {k: v * 1.01 for k, v in worker.policy.state_dict_for_checkpoint().items()}
    worker.set_weights(pushed, version=1)
    eager_new, compiled_new = _velocity(worker.policy, False, inputs), _velocity(worker.policy, True, inputs)
    assert (eager_new - eager).abs().max().item() > 100 * RELATIVE_TOLERANCE * scale  # the push changed the model
    assert (compiled_new - eager_new).abs().max().item() <= RELATIVE_TOLERANCE * scale
    assert worker.torch_compile_stats()["graphs"] == graphs


def test_a_training_request_reuses_the_compiled_graph_and_a_validation_request_runs_eager(compiled_worker):
    """The worker's requests as the trainer sends them: a training request's batch (rollout.n samples of one prompt)
    has the shape the fixture compiled, so no new graph; a validation request (val_kwargs.n=1: another shape) runs
    eager, so no graph either, where a compiled one would have needed one."""
    worker, _, _ = compiled_worker
    rollout = worker.config.actor_rollout_ref.rollout
    partition = f"compile-{uuid.uuid4().hex[:8]}/train"
    records = [PromptRecord(prompt="a red circle", index=0)]
    graphs = worker.torch_compile_stats()["graphs"]
    try:
        for kind, params in (("train", SamplingParams.for_training(rollout)), ("val", SamplingParams.for_validation(rollout))):
            request = RolloutRequest.of_records(partition, 1, params, records, uid_prefix=kind)
            tqc.put_prompts(partition, request.uids, request.global_step)
            result = worker.generate(request)
            assert result.num_samples == params.n and not result.failed, (kind, result)
            assert worker.torch_compile_stats()["graphs"] == graphs, kind
        assert worker.policy.torch_compile  # the validation request switched it off for its own duration only
    finally:
        tqc.clear_partition(partition)


@pytest.mark.parametrize("lora", [False, True], ids=["full_kl_reference_copy", "lora_kl_adapters_off"])
def test_the_actor_switch_compiles_old_log_probs_update_and_reference(tiny_sd3_dir, one_torch_thread, lora):
    """The trained transformer (peft model under LoRA) and the KL reference (a frozen copy, or the same model with
    its adapters off) go through compiled graphs; the first on-policy ratio stays exactly 1."""
    overrides = [
        *TINY,
        f"actor_rollout_ref.model.path={tiny_sd3_dir}",
        "actor_rollout_ref.actor.use_torch_compile=true",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.1",
    ]
    if lora:
        overrides += ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"]
    config = load_config(overrides=overrides)
    actor = TrainingActor(config.model_dump(mode="json"), total_training_steps=2, num_threads=1, text_encoders=True)
    assert actor.policy.torch_compile  # the key switched it on; Inductor swapped for aot_eager (module docstring)
    actor.policy.enable_torch_compile(backend="aot_eager")
    params = SamplingParams.for_training(config.actor_rollout_ref.rollout)
    actor.policy.torch_compile = False  # an eager rollout with the same weights (the rollout switch stays off)
    traj = generate(actor.policy, ["a red circle"], prompt_indices=[0], **params.generate_kwargs(1))
    actor.policy.torch_compile = True

    before = actor.torch_compile_stats()
    metrics = actor.train_on(traj, torch.tensor([1.0, -1.0]), 1)
    after = actor.torch_compile_stats()
    assert set(actor.policy.compiled_modules()) == {"trained", "reference"}
    assert all(isinstance(m, OptimizedModule) for m in actor.policy.compiled_modules().values())
    # old log-probs (no grad, eval), the update (grad, train) and the reference (no grad; other weights or adapters)
    assert after["graphs"] - before["graphs"] >= 3, (before, after)
    assert metrics["actor/ratio_mean"] == 1.0 and metrics["actor/ratio_std"] == 0.0
    assert metrics["actor/kl_loss"] == 0.0  # the policy is still the reference at the first update
    assert metrics["training/rollout_probs_diff_max"] < 1e-5  # eager rollout vs compiled recomputation


def test_both_switches_are_off_by_default_and_validated_like_every_key(tiny_sd3_dir):
    defaults = load_config()
    assert not defaults.actor_rollout_ref.actor.use_torch_compile
    assert not defaults.actor_rollout_ref.rollout.use_torch_compile
    on = ["actor_rollout_ref.actor.use_torch_compile=true", "actor_rollout_ref.rollout.use_torch_compile=true"]
    # Every combination the issue names works (ddp / fsdp2 ranks, LoRA, CFG, KL reference): nothing is refused.
    for extra in (
        [],
        [
            "actor_rollout_ref.actor.strategy=ddp",
            "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        ],
        [
            "actor_rollout_ref.actor.strategy=fsdp2",
            "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.model.lora_rank=4",
        ],
        ["actor_rollout_ref.rollout.pipeline.guidance_scale=4.0", "actor_rollout_ref.actor.use_kl_loss=true"],
    ):
        config = load_config(overrides=[*TINY, f"actor_rollout_ref.model.path={tiny_sd3_dir}", *on, *extra])
        assert not config_problems(config, CPU_ONLY), extra
    with pytest.raises(ConfigError) as err:
        load_config(
            overrides=["actor_rollout_ref.actor.use_torch_compile=sometimes", "actor_rollout_ref.rollout.use_torch_compiled=true"]
        )
    assert err.value.keys == ["actor_rollout_ref.rollout.use_torch_compiled", "actor_rollout_ref.actor.use_torch_compile"]
    assert "did you mean actor_rollout_ref.rollout.use_torch_compile" in str(err.value)


def test_compile_on_ascend_npu_is_refused_naming_each_key():
    on = ["actor_rollout_ref.actor.use_torch_compile=true", "actor_rollout_ref.rollout.use_torch_compile=true"]
    config = load_config(overrides=["trainer.device=npu", *on])
    problems = [p for p in config_problems(config, {"npu": 1, "cuda": 0, "cpu": 2}) if "use_torch_compile" in p.key]
    assert [p.key for p in problems] == [
        "actor_rollout_ref.actor.use_torch_compile",
        "actor_rollout_ref.rollout.use_torch_compile",
    ]
    assert all("set it to false" in p.message and "npu" in p.message for p in problems)
    eager = load_config(overrides=["trainer.device=npu"])
    assert not [p for p in config_problems(eager, {"npu": 1, "cuda": 0, "cpu": 2}) if "use_torch_compile" in p.key]
