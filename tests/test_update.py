"""ppo_update and the optimizer / LR builders, on a tiny real velocity model.

The step_fn here re-scores stored transitions with a plain Gaussian Euler step of fixed std,
``x_next ~ N(x + v(x, t, c) * dt, STD^2)``, log-prob averaged over latent dims as in Flow-GRPO;
the real SDE step lives in omni_core.sde, which is not what these tests are about.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from omni_core.algorithms.update import PPOUpdateConfig, StepOutput, build_lr_scheduler, build_optimizer, ppo_update

torch.set_num_threads(1)

B, W, C, H = 8, 3, 2, 4  # samples, window steps, latent channels, latent side
DT, STD = -0.1, 0.5


class TinyVelocity(nn.Module):
    """v(x, t, c): a 3x3 conv over [latent, timestep plane] plus a per-sample condition bias."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(C + 1, C, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        t_plane = t.view(-1, 1, 1, 1).expand(-1, 1, H, H)
        return self.conv(torch.cat([x, t_plane], dim=1)) + cond.view(-1, C, 1, 1)


def gaussian_log_prob(x_next, mean):
    logp = -((x_next - mean) ** 2) / (2 * STD**2) - math.log(STD) - 0.5 * math.log(2 * math.pi)
    return logp.mean(dim=(1, 2, 3))


def make_step_fn(model, ref_model=None):
    def step_fn(micro, j):
        x, x_next = micro["latents"][:, j], micro["latents"][:, j + 1]
        mean = x + model(x, micro["timesteps"][:, j], micro["cond"]) * DT
        ref_mean = None
        if ref_model is not None:
            with torch.no_grad():
                ref_mean = x + ref_model(x, micro["timesteps"][:, j], micro["cond"]) * DT
        return StepOutput(gaussian_log_prob(x_next, mean), mean, STD, ref_mean)

    return step_fn


def rollout(model, seed=0):
    """Sample a window of W transitions per sample; returns the batch without old_log_probs."""
    gen = torch.Generator().manual_seed(seed)
    cond = torch.randn(B, C, generator=gen)
    timesteps = torch.linspace(1.0, 0.7, W).repeat(B, 1)
    latents = [torch.randn(B, C, H, H, generator=gen)]
    with torch.no_grad():
        for j in range(W):
            mean = latents[-1] + model(latents[-1], timesteps[:, j], cond) * DT
            latents.append(mean + STD * torch.randn(mean.shape, generator=gen))
    return {"latents": torch.stack(latents, dim=1), "timesteps": timesteps, "cond": cond}


def score_log_probs(model, batch, micro_batch_size):
    """old_log_probs recomputed with the training micro-batch split (verl-omni's old-log-prob pass)."""
    step_fn = make_step_fn(model)
    rows = []
    with torch.no_grad():
        for idx in torch.arange(B).split(micro_batch_size):
            micro = {k: v[idx] for k, v in batch.items()}
            rows.append(torch.stack([step_fn(micro, j).log_prob for j in range(W)], dim=1))
    return torch.cat(rows)


def make_cfg(**overrides):
    base = dict(
        mini_batch_size=B,
        micro_batch_size=2,
        ppo_epochs=1,
        clip_ratio=1e-4,
        adv_clip_max=5.0,
        kl_coef=0.0,
        grad_clip=1.0,
        shuffle=False,
        seed=0,
    )
    return PPOUpdateConfig(**{**base, **overrides})


@pytest.fixture()
def setup():
    torch.manual_seed(0)
    model = TinyVelocity()
    batch = rollout(model)
    batch["old_log_probs"] = score_log_probs(model, batch, micro_batch_size=2)
    batch["advantages"] = torch.tensor([1.0, -1.0] * (B // 2))
    return model, batch


def test_first_micro_step_is_exactly_on_policy(setup):
    model, batch = setup
    seen = []
    step_fn = make_step_fn(model)

    def recording(micro, j):
        out = step_fn(micro, j)
        seen.append((micro["old_log_probs"][:, j], out.log_prob.detach()))
        return out

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    metrics = ppo_update(model, optimizer, None, batch, step_fn=recording, cfg=make_cfg())
    # one mini-batch = one optimizer step at its end: every ratio of the call is exactly 1
    old, new = seen[0]
    assert torch.equal(torch.exp(new - old), torch.ones(2))
    assert metrics["actor/ratio_mean"] == 1.0 and metrics["actor/ratio_std"] == 0.0
    assert metrics["actor/ppo_kl"] == 0.0 and metrics["actor/pg_clipfrac"] == 0.0
    assert len(seen) == (B // 2) * W
    expected = {
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/pg_clipfrac_higher",
        "actor/pg_clipfrac_lower",
        "actor/ppo_kl",
        "actor/ratio_mean",
        "actor/ratio_std",
        "actor/kl_loss",
        "actor/grad_norm",
        "actor/lr",
        "actor/skipped_optimizer_steps",
    }
    assert expected == set(metrics)
    assert metrics["actor/skipped_optimizer_steps"] == 0.0


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_updates_move_the_log_prob_with_the_sign_of_the_advantage(setup, sign):
    model, batch = setup
    batch["advantages"] = torch.full((B,), sign)
    before = batch["old_log_probs"].mean().item()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = make_cfg(mini_batch_size=4, clip_ratio=0.2)
    for _ in range(3):  # three training steps, each on-policy for the fixed batch
        batch["old_log_probs"] = score_log_probs(model, batch, micro_batch_size=2)
        ppo_update(model, optimizer, None, batch, step_fn=make_step_fn(model), cfg=cfg)
    after = score_log_probs(model, batch, micro_batch_size=2).mean().item()
    assert sign * (after - before) > 1e-3


def test_optimizer_steps_equal_epochs_times_minibatches_and_scheduler_steps_once(setup):
    model, batch = setup
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = []
    optimizer.register_step_post_hook(lambda *_: steps.append(1))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    calls = []
    step_fn = make_step_fn(model)
    cfg = make_cfg(mini_batch_size=4, micro_batch_size=2, ppo_epochs=3, shuffle=True)
    metrics = ppo_update(model, optimizer, scheduler, batch, step_fn=lambda m, j: calls.append(j) or step_fn(m, j), cfg=cfg)
    assert len(steps) == 3 * (B // 4)  # ppo_epochs x n_minibatches = 3 x 2
    assert len(calls) == 3 * (B // 2) * W  # epochs x micro-batches x window steps
    assert scheduler.last_epoch == 1  # stepped once per training step
    assert metrics["actor/lr"] == 1e-3  # the lr this step ran with, not the next one
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5e-3)


def test_shuffle_is_seeded(setup):
    model, batch = setup
    results = []
    for _ in range(2):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        cfg = make_cfg(mini_batch_size=2, shuffle=True, seed=7, clip_ratio=0.5)
        ppo_update(m, opt, None, batch, step_fn=make_step_fn(m), cfg=cfg)
        results.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    assert torch.equal(results[0], results[1])


def test_grad_norm_is_reported_and_clipped(setup):
    model, batch = setup
    # Independent reference: the mean over micro-batches and window steps of the loss, one backward.
    ref = copy.deepcopy(model)
    step_fn = make_step_fn(ref)
    total = 0.0
    for idx in torch.arange(B).split(2):
        micro = {k: v[idx] for k, v in batch.items()}
        for j in range(W):
            ratio = torch.exp(step_fn(micro, j).log_prob - micro["old_log_probs"][:, j])
            adv = micro["advantages"]
            total = total + torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - 1e-4, 1 + 1e-4)).mean()
    (total / ((B // 2) * W)).backward()
    norm = torch.cat([p.grad.flatten() for p in ref.parameters()]).norm().item()

    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    clip = norm / 4
    metrics = ppo_update(model, optimizer, None, batch, step_fn=make_step_fn(model), cfg=make_cfg(grad_clip=clip))
    assert metrics["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)
    # SGD with lr 1 moves the weights by exactly the clipped gradient, whose norm is grad_clip
    moved = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before, strict=True)]).norm()
    assert moved.item() == pytest.approx(clip, rel=1e-4)


def test_kl_term_zero_for_identical_reference_positive_otherwise(setup):
    model, batch = setup
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    same = copy.deepcopy(model)
    m = ppo_update(model, optimizer, None, batch, step_fn=make_step_fn(model, same), cfg=make_cfg(kl_coef=0.1))
    assert m["actor/kl_loss"] == 0.0
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.conv.bias.add_(1.0)
    m = ppo_update(model, optimizer, None, batch, step_fn=make_step_fn(model, other), cfg=make_cfg(kl_coef=0.1))
    # mean shift = bias shift * |dt| = 0.1 everywhere: KL = 0.1^2 / (2 * 0.5^2) = 0.02
    assert m["actor/kl_loss"] == pytest.approx(0.02, rel=1e-4)
    with pytest.raises(ValueError, match="ref_prev_sample_mean"):
        ppo_update(model, optimizer, None, batch, step_fn=make_step_fn(model), cfg=make_cfg(kl_coef=0.1))


def test_batch_sizes_must_divide(setup):
    model, batch = setup
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not divisible by mini_batch_size=3"):
        ppo_update(model, optimizer, None, batch, step_fn=make_step_fn(model), cfg=make_cfg(mini_batch_size=3))
    with pytest.raises(ValueError, match="not divisible by dp_size=3"):
        ppo_update(model, optimizer, None, batch, step_fn=make_step_fn(model), cfg=make_cfg(dp_size=3, dp_rank=0))


def test_an_uneven_micro_batch_split_trains_the_mean_over_the_mini_batch(setup):
    """Mini-batches of 4 (two optimizer steps on the 8 samples) in micro-batches of 3 and 1 (the last one smaller, as
    after algorithm.filter_zero_std_groups) take the steps of one micro-batch of 4: the gradient of the mean loss over
    the mini-batch's samples. Weighting the two micro-batches equally (1/2 each instead of 3/4 and 1/4) would move the
    weights elsewhere."""
    import copy

    model, batch = setup
    moved = {}
    for micro in (4, 3, 1):
        trained = copy.deepcopy(model)
        optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)  # the step is the gradient itself: -0.1 g
        cfg = make_cfg(mini_batch_size=4, micro_batch_size=micro, grad_clip=1e9)
        ppo_update(trained, optimizer, None, batch, step_fn=make_step_fn(trained), cfg=cfg)
        moved[micro] = torch.cat([(a - b).flatten() for a, b in zip(trained.parameters(), model.parameters(), strict=True)])
    assert moved[4].norm() > 0
    for micro in (3, 1):
        assert torch.allclose(moved[micro], moved[4], rtol=1e-5, atol=1e-9), (micro, (moved[micro] - moved[4]).abs().max())


# ----------------------------------------------------------------------------------------- builders


def _optim_cfg(**kw):
    base = dict(lr=1e-3, betas=[0.9, 0.99], weight_decay=0.01, lr_warmup_steps=-1, lr_scheduler_type="constant")
    return SimpleNamespace(**{**base, **kw})


def _lrs(scheduler, n):
    values = []
    for _ in range(n):
        values.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return values


def test_build_optimizer_reads_the_section_and_skips_frozen_params():
    model = TinyVelocity()
    model.conv.bias.requires_grad_(False)
    opt = build_optimizer(_optim_cfg(), model.parameters())
    group = opt.param_groups[0]
    assert isinstance(opt, torch.optim.AdamW)
    assert (group["lr"], group["betas"], group["weight_decay"]) == (1e-3, (0.9, 0.99), 0.01)
    assert len(group["params"]) == 1  # the frozen bias is left out


def test_constant_schedule_with_linear_warmup():
    model = TinyVelocity()
    cfg = _optim_cfg(lr_warmup_steps=4)
    sched = build_lr_scheduler(cfg, build_optimizer(cfg, model.parameters()), total_training_steps=10)
    # s / 4 for s < 4, then 1:  [0, .25, .5, .75, 1, 1] x 1e-3
    assert _lrs(sched, 6) == pytest.approx([0.0, 0.25e-3, 0.5e-3, 0.75e-3, 1e-3, 1e-3])
    no_warmup = build_lr_scheduler(_optim_cfg(), build_optimizer(cfg, model.parameters()), 10)
    assert _lrs(no_warmup, 2) == pytest.approx([1e-3, 1e-3])


def test_cosine_schedule_after_warmup_reaches_zero_at_the_last_step():
    cfg = _optim_cfg(lr_warmup_steps=2, lr_scheduler_type="cosine")
    sched = build_lr_scheduler(cfg, build_optimizer(cfg, TinyVelocity().parameters()), total_training_steps=10)
    lrs = _lrs(sched, 11)
    # warm-up 0, 0.5; then 0.5 (1 + cos(pi (s - 2) / 8)): s=2 -> 1, s=4 -> (1 + cos(pi/4)) / 2, s=6 -> 0.5, s=10 -> 0
    assert lrs[0] == 0.0 and lrs[1] == pytest.approx(0.5e-3)
    assert lrs[2] == pytest.approx(1e-3)
    assert lrs[4] == pytest.approx(1e-3 * (1 + math.cos(math.pi / 4)) / 2)
    assert lrs[6] == pytest.approx(0.5e-3)
    assert lrs[10] == pytest.approx(0.0, abs=1e-12)


def test_unknown_schedule_is_rejected():
    cfg = _optim_cfg(lr_scheduler_type="linear")
    with pytest.raises(ValueError, match=r"unknown lr_scheduler_type 'linear'.*cosine"):
        build_lr_scheduler(cfg, build_optimizer(cfg, TinyVelocity().parameters()), 10)
