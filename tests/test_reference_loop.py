"""benchmarks/reference_loop.py, the independent Flow-GRPO baseline: its formulas against omni_core's, and one tiny run.

The reference is written from the paper's equations without importing OmniFlow; these checks are what make
`bench_core.py`'s plain-vs-reference comparison mean "the same algorithm, two implementations".
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from omni_core.algorithms.flow_grpo import compute_flow_grpo_advantages
from omni_core.config import load_config
from omni_core.rewards.builtin import jpeg_compressibility
from omni_core.sde import sde_step_from_sigmas

pytestmark = pytest.mark.bench  # a benchmark script: `make test-bench` (CI runs it)

REFERENCE_FILE = Path(__file__).resolve().parents[1] / "benchmarks" / "reference_loop.py"


@pytest.fixture(scope="module")
def ref():
    """The benchmark script as a module (benchmarks/ is no package); registered while the tests run (dataclasses
    look their module up in sys.modules)."""
    spec = importlib.util.spec_from_file_location("reference_loop", REFERENCE_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def _sde_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, 8, 8, generator=g)
    v = torch.randn(4, 16, 8, 8, generator=g)
    # Row 0 starts at sigma = 1 (sigma_max replaces it in 1 - sigma); row 3 ends at sigma_next = 0 (last step).
    sigma = torch.tensor([1.0, 0.75, 0.4, 0.2])
    sigma_next = torch.tensor([0.9, 0.6, 0.25, 0.0])
    return v, x, sigma, sigma_next


def test_sde_step_equals_omni_core_on_the_same_tensors(ref):
    v, x, sigma, sigma_next = _sde_inputs()
    sigma_max, a = 0.9, 0.7
    prev = x + 0.1 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1))

    # Scoring a given transition: mean, std and log-prob.
    _, lp_ref, mean_ref, std_ref = ref.sde_transition(v, x, sigma, sigma_next, sigma_max, a, prev_sample=prev)
    _, lp_core, mean_core, std_core = sde_step_from_sigmas(v, x, sigma, sigma_next, sigma_max, a, prev_sample=prev)
    torch.testing.assert_close(mean_ref, mean_core, rtol=0, atol=1e-6)
    torch.testing.assert_close(std_ref, std_core, rtol=0, atol=1e-6)
    torch.testing.assert_close(lp_ref, lp_core, rtol=0, atol=1e-6)
    # Independent check of one row against the formula written out: sigma_t = a sqrt(t / (1 - t)), t = 0.75.
    assert math.isclose(float(std_ref[1]), a * math.sqrt(0.75 / 0.25), rel_tol=1e-6)
    assert math.isclose(float(std_ref[0]), a * math.sqrt(1.0 / (1 - sigma_max)), rel_tol=1e-6)

    # Sampling with the same noise (omni_core draws it from the generator; the reference takes it as input).
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    x_ref, lp_ref, _, _ = ref.sde_transition(v, x, sigma, sigma_next, sigma_max, a, noise=noise)
    x_core, lp_core, _, _ = sde_step_from_sigmas(
        v, x, sigma, sigma_next, sigma_max, a, generator=torch.Generator().manual_seed(7)
    )
    torch.testing.assert_close(x_ref, x_core, rtol=0, atol=1e-6)
    torch.testing.assert_close(lp_ref, lp_core, rtol=0, atol=1e-6)


def test_reward_and_advantages_equal_omni_core(ref):
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (6, 3, 32, 32), generator=g, dtype=torch.uint8)
    images[0] = 128  # a flat image compresses far better than noise
    scores = ref.jpeg_compressibility(images)
    assert torch.equal(scores, torch.tensor([jpeg_compressibility(img) for img in images], dtype=torch.float32))
    assert scores[0] > scores[1:].max()

    rewards = torch.randn(12, generator=g)
    expected = compute_flow_grpo_advantages(rewards, torch.arange(3).repeat_interleave(4))
    torch.testing.assert_close(ref.grpo_advantages(rewards, 4), expected, rtol=0, atol=1e-6)


def test_cli_defaults_are_omniflows_defaults(ref):
    """The reference's flags default to omni_core/config/defaults.yaml, so `bench_core` compares like with like."""
    cfg = load_config()
    arr = cfg.actor_rollout_ref
    ns = ref.build_parser().parse_args([])
    expected = {
        "prompts_per_step": cfg.data.train_batch_size,
        "n": arr.rollout.n,
        "height": arr.rollout.pipeline.height,
        "width": arr.rollout.pipeline.width,
        "num_steps": arr.rollout.pipeline.num_inference_steps,
        "noise_level": arr.rollout.algo.noise_level,
        "window_size": arr.rollout.algo.sde_window_size,
        "window_range": list(arr.rollout.algo.sde_window_range),
        "max_sequence_length": arr.rollout.pipeline.max_sequence_length,
        "lr": arr.actor.optim.lr,
        "weight_decay": arr.actor.optim.weight_decay,
        "betas": list(arr.actor.optim.betas),
        "grad_clip": arr.actor.grad_clip,
        "clip_ratio": arr.actor.diffusion_loss.clip_ratio,
        "adv_clip_max": arr.actor.diffusion_loss.adv_clip_max,
        "mini_batch_prompts": arr.actor.ppo_mini_batch_size,
        "micro_batch": arr.actor.ppo_micro_batch_size_per_gpu,
    }
    assert {k: getattr(ns, k) for k in expected} == expected
    assert arr.rollout.pipeline.guidance_scale == 1.0  # the reference has no CFG
    assert not arr.actor.use_kl_loss and arr.actor.ppo_epochs == 1  # nor a KL term or several PPO epochs


def test_one_tiny_reference_step_runs_on_policy(ref, tiny_sd3_dir, one_torch_thread):
    cfg = ref.ReferenceConfig(
        model_path=str(tiny_sd3_dir),
        prompts=["a red circle", "a blue square"],
        n=2,
        height=32,
        width=32,
        num_steps=2,
        window_size=2,
        window_range=(0, 2),  # both steps: the first starts at sigma = 1, the last ends at 0
        threads=1,
    )
    (step,) = ref.run_reference(cfg, steps=1)
    assert step["images"] == 4 and step["window_start"] == 0
    assert math.isfinite(step["reward_mean"]) and -0.1 < step["reward_mean"] < 0
    # Rollout log-probs are the old log-probs and nothing has moved the weights yet: every ratio is exactly 1.
    assert step["ratio_mean"] == 1.0 and step["ratio_max_abs_dev"] == 0.0
    assert math.isfinite(step["grad_norm"]) and step["grad_norm"] > 0


@pytest.mark.parametrize("dynamic_shifting", [False, True])
def test_timestep_schedule_equals_omni_cores(ref, tiny_sd3_dir, dynamic_shifting):
    from diffusers import FlowMatchEulerDiscreteScheduler

    from omni_core.models.arch import SD3Adapter

    pipe = ref.load_pipeline(ref.ReferenceConfig(model_path=str(tiny_sd3_dir), prompts=[]))
    fixed_shift = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)  # the tiny model's: shift 3
    fixed_shift.set_timesteps(10)
    # SD3.5-style configs shift by the image's token count instead (256 tokens at 64 px: exp(0.5), not 3).
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        {**pipe.scheduler.config, "use_dynamic_shifting": dynamic_shifting}
    )
    timesteps, sigmas = (t.clone() for t in ref.schedule(pipe, 10, 64, 64))
    SD3Adapter(pipe).set_timesteps(pipe.scheduler, 10, 64, 64)
    assert torch.equal(timesteps, pipe.scheduler.timesteps.float()) and torch.equal(sigmas, pipe.scheduler.sigmas.float())
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0 and len(timesteps) == 10
    assert torch.equal(sigmas, fixed_shift.sigmas.float()) != dynamic_shifting
