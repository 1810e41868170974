"""`PolicyTrainer` in-process on the tiny SD3 model (no Ray, no TransferQueue): the update's sign, the first ratio,
what the loss declares, state dicts, and that the module needs neither Ray nor the TransferQueue."""

from __future__ import annotations

import ast
import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from flow_utils import DIFFUSION_DPO, DIFFUSION_NFT, SMALL_ACTOR_STEP

from omni_core.config import load_config
from omni_core.rollout.sampler import generate
from omni_core.rollout.sampling_params import SamplingParams
from omni_core.workers.policy_trainer import PolicyTrainer


def _trainer(tiny_sd3_dir, *extra: str) -> PolicyTrainer:
    overrides = [*SMALL_ACTOR_STEP, f"actor_rollout_ref.model.path={tiny_sd3_dir}", "actor_rollout_ref.actor.optim.lr=1e-3"]
    return PolicyTrainer(load_config(overrides=[*overrides, *extra]), total_training_steps=4, text_encoders=True)


def _rollout(trainer: PolicyTrainer, step: int):
    params = SamplingParams.for_training(trainer.config.actor_rollout_ref.rollout)
    return generate(trainer.policy, ["a red circle", "a blue square"], prompt_indices=[0, 1], **params.generate_kwargs(step))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_an_update_moves_each_log_prob_with_the_sign_of_its_advantage(tiny_sd3_dir, one_torch_thread, sign):
    trainer = _trainer(tiny_sd3_dir)
    traj = _rollout(trainer, 1)
    advantages = sign * torch.tensor([1.0, -1.0] * 4)  # 8 samples: 2 prompts x rollout.n=4
    before = trainer.old_log_probs(traj).mean(dim=1)  # [B]: each stored trajectory's log-prob per window step
    metrics = trainer.train_on(traj, advantages, 1)
    after = trainer.old_log_probs(traj).mean(dim=1)
    # One mini-batch of all 8 samples: its forwards all run before its one optimizer step, so every ratio is 1.
    assert metrics["actor/ratio_mean"] == 1.0 and metrics["actor/ratio_std"] == 0.0
    assert trainer.version == 1 and metrics["actor/skipped_optimizer_steps"] == 0.0
    moved = after - before
    favoured, disfavoured = (moved[0::2], moved[1::2]) if sign > 0 else (moved[1::2], moved[0::2])
    # The samples with a positive advantage gain log-prob relative to those with a negative one.
    assert favoured.mean() > disfavoured.mean()
    assert favoured.mean() > 0 > disfavoured.mean()


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_window_that_includes_the_last_step_trains_it_on_policy(tiny_sd3_dir, one_torch_thread, sign):
    """flow_grpo's base config: every one of the 4 steps is an SDE step, the last one to sigma 0 included. Its log-prob
    is recorded and finite, the first ratio is exactly 1 and the update moves log-probs with the advantages' sign."""
    every_step = ["actor_rollout_ref.rollout.algo.sde_window_size=4", "actor_rollout_ref.rollout.algo.sde_window_range=[0,4]"]
    trainer = _trainer(tiny_sd3_dir, *every_step)
    traj = _rollout(trainer, 1)
    assert traj.window_size == 4 and torch.equal(traj.sigmas[:, -1], torch.zeros(8))
    assert torch.isfinite(traj.log_probs).all()
    advantages = sign * torch.tensor([1.0, -1.0] * 4)
    before = trainer.old_log_probs(traj)
    # The last step re-scored as the rollout scored it (to rounding: the rollout ran all 8 samples in one batch).
    torch.testing.assert_close(before[:, -1], traj.log_probs[:, -1], rtol=1e-5, atol=1e-5)
    metrics = trainer.train_on(traj, advantages, 1)
    assert metrics["actor/ratio_mean"] == 1.0 and metrics["actor/ratio_std"] == 0.0
    moved = (trainer.old_log_probs(traj) - before).mean(dim=1)
    favoured, disfavoured = (moved[0::2], moved[1::2]) if sign > 0 else (moved[1::2], moved[0::2])
    assert favoured.mean() > disfavoured.mean()


@pytest.mark.parametrize("loss_mode", ["grpo_guard", "flow_dppo"])
def test_a_trust_region_loss_gets_the_old_policys_means_and_trains_with_the_sign_of_the_advantage(
    tiny_sd3_dir, one_torch_thread, loss_mode
):
    """GRPO-Guard and Flow-DPPO read the old policy's transition means (from the old-log-prob pass) and sqrt(-dt): on
    the first, on-policy mini-batch the means agree exactly, so GRPO-Guard's drift term is 0 and every ratio is exactly
    1, and Flow-DPPO masks nothing (every KL is 0); the update then favours the samples with a positive advantage."""
    trainer = _trainer(tiny_sd3_dir, f"actor_rollout_ref.actor.diffusion_loss.loss_mode={loss_mode}")
    assert {"old_prev_sample_mean", "prev_sample_mean", "std_dev_t", "sqrt_dt"} <= trainer.needs
    traj = _rollout(trainer, 1)
    means: dict[str, torch.Tensor] = {}
    before = trainer.old_log_probs(traj, means).mean(dim=1)
    assert means["old_prev_sample_mean"].shape == traj.latents[:, 1:].shape
    advantages = torch.tensor([1.0, -1.0] * 4)
    metrics = trainer.train_on(traj, advantages, 1)
    assert metrics["actor/ratio_mean"] == 1.0
    if loss_mode == "grpo_guard":
        assert metrics["actor/ratio_mean_bias"] == 0.0
    else:
        assert metrics["actor/masked_fraction"] == 0.0 and metrics["actor/kl_new_old_max"] == 0.0
    moved = trainer.old_log_probs(traj).mean(dim=1) - before
    assert moved[0::2].mean() > 0 > moved[1::2].mean()


def test_only_what_the_loss_declares_is_computed(tiny_sd3_dir, one_torch_thread):
    plain = _trainer(tiny_sd3_dir)
    assert plain.needs == {"log_prob", "old_log_prob", "advantages", "rollout_weight"}
    assert plain.policy._reference is None  # no KL term: no reference copy and no reference pass
    traj = _rollout(plain, 1)
    assert plain.reference_predictions(traj) == {}

    kl = _trainer(tiny_sd3_dir, "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=velocity")
    assert kl.needs == {"log_prob", "old_log_prob", "advantages", "rollout_weight", "velocity", "ref_velocity"}
    refs = kl.reference_predictions(traj)
    assert set(refs) == {"ref_velocity"} and refs["ref_velocity"].shape == traj.latents[:, 1:].shape
    # The reference is the base model: its velocity at step 0 equals the policy's before any update.
    with torch.no_grad():
        velocity = kl.score(traj, 0).velocity
    torch.testing.assert_close(refs["ref_velocity"][:, 0], velocity.float())


def test_state_dict_round_trip_restores_weights_optimizer_and_version(tiny_sd3_dir, one_torch_thread):
    trainer = _trainer(tiny_sd3_dir)
    trainer.train_on(_rollout(trainer, 1), torch.linspace(-1, 1, 8), 1)
    state = copy.deepcopy(trainer.state_dict())  # the optimizer's state dict holds its live moment tensors
    saved = state["model"]
    trainer.train_on(_rollout(trainer, 2), torch.linspace(-1, 1, 8), 2)
    assert not all(torch.equal(saved[k], v) for k, v in trainer.state_dict()["model"].items())
    trainer.load_state_dict(copy.deepcopy(state))
    assert trainer.version == 1 and trainer.lr_scheduler.last_epoch == 1
    assert all(torch.equal(saved[k], v) for k, v in trainer.state_dict()["model"].items())


def _imports(path: Path, everywhere: bool) -> set[str]:
    """Absolute module names a file imports: anywhere in it, or only at module level (what importing it runs)."""
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree) if everywhere else iter(tree.body)
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_policy_trainer_imports_neither_ray_nor_the_transfer_queue():
    """policy_trainer.py names neither anywhere, and neither do the omni_core modules that importing it runs."""
    forbidden = ("ray", "transfer_queue", "omni_core.tq")
    start = "omni_core.workers.policy_trainer"
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        spec = importlib.util.find_spec(name)
        if name in seen or spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        seen.add(name)
        imported = _imports(Path(spec.origin), everywhere=name == start)
        bad = sorted(i for i in imported if any(i == f or i.startswith(f + ".") for f in forbidden))
        assert not bad, f"{name} imports {bad}"
        todo += [i for i in imported if i.startswith("omni_core") and _is_module(i)]
        todo += [name.rsplit(".", 1)[0]] if "." in name else []  # its packages' __init__ run too
    assert "omni_core.algorithms.update" in seen and "omni_core.models.policy" in seen  # the walk did follow imports


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


NFT = DIFFUSION_NFT  # verl-omni's DiffusionNFT keys, with a LoRA old policy


def _flow_matching_error(trainer: PolicyTrainer, traj, t: float = 0.6) -> torch.Tensor:
    """Per sample: mean((v_theta(x_t) - (eps - x0))^2) at one fixed forward-process point of its final latents."""
    x0 = traj.latents[:, -1]
    eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(123))
    x_t = (1 - t) * x0 + t * eps
    with torch.no_grad():
        v = trainer.policy.velocity(x_t, torch.full((x0.shape[0],), t * 1000), traj.cond, height=32, width=32)
    return ((v - (eps - x0)) ** 2).flatten(1).mean(dim=1)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_diffusion_nft_trains_on_its_ode_rollout_towards_the_better_samples(tiny_sd3_dir, one_torch_thread, sign):
    """The NFT rollout records every step of the deterministic ODE and no log-probs; the update's first forwards are
    on-policy (the old policy is the trained one: its velocity equals the current one's exactly, `old_deviate` 0);
    afterwards the flow-matching error of the samples with a positive advantage falls relative to the others' (the
    implicit positive policy fits them, the negative one is pushed away), and `copy` makes the old policy the new one."""
    trainer = _trainer(tiny_sd3_dir, *NFT)
    assert trainer.forward_process and {"forward_latents", "old_velocity", "final_latents"} <= trainer.needs
    params = SamplingParams.for_training(trainer.config.actor_rollout_ref.rollout, "diffusion_nft")
    assert params.noise_level == 0.0 and params.old_policy and not params.calculate_log_probs
    traj = generate(trainer.policy, ["a red circle", "a blue square"], prompt_indices=[0, 1], **params.generate_kwargs(1))
    assert traj.window_size == 4 and torch.isnan(traj.log_probs).all()  # every step recorded, no log-probs
    sigmas = traj.sigmas[0]
    # The Euler ODE: each recorded step is x + v dt exactly (replayed here with the policy's own velocity).
    v0 = trainer.policy.velocity(traj.latents[:, 0], traj.timesteps[:, 0], traj.cond, height=32, width=32).detach()
    assert torch.allclose(traj.latents[:, 1], traj.latents[:, 0] + v0 * (sigmas[1] - sigmas[0]), atol=1e-6)

    before = _flow_matching_error(trainer, traj)
    advantages = sign * torch.tensor([1.0, -1.0] * 4)
    metrics = trainer.train_on(traj, advantages, 1)
    assert metrics["actor/old_deviate"] == 0.0  # one mini-batch: every forward before its optimizer step
    assert metrics["actor/reward_prob_mean"] == pytest.approx(0.5)  # r = 0.6 and 0.4 in pairs
    assert metrics["actor/old_policy_refreshed"] == 1.0 and metrics["actor/old_policy_decay"] == 0.0
    assert all(torch.equal(trainer.old_policy[k], v) for k, v in trainer.trainable_state().items())  # copy
    change = _flow_matching_error(trainer, traj) - before
    better, worse = (change[0::2], change[1::2]) if sign > 0 else (change[1::2], change[0::2])
    assert better.mean() < worse.mean(), (better, worse)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_online_dpo_trains_its_pairs_towards_the_chosen_samples(tiny_sd3_dir, one_torch_thread, sign):
    """The DPO rollout is the ODE with only the last step recorded (the final latents) and no log-probs; each group's
    best and worst samples form a pair; at the first forwards the policy is the reference (LoRA starts at zero), so
    every pair's loss is log 2; after the update the chosen samples' flow-matching error falls relative to the
    rejected ones' (negating the rewards chooses the other samples, and the test then expects the opposite)."""
    from omni_core.algorithms.diffusion_dpo import preference_pairs

    trainer = _trainer(tiny_sd3_dir, *DIFFUSION_DPO, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2")
    assert trainer.forward_process and trainer.old_policy is None and "old_velocity" not in trainer.needs
    assert trainer.update_config(1).mini_batch_size == 4  # ppo_mini_batch_size=2 prompts x one pair each
    params = SamplingParams.for_training(trainer.config.actor_rollout_ref.rollout, "dpo")
    assert params.noise_level == 0.0 and not params.calculate_log_probs and not params.old_policy
    traj = generate(trainer.policy, ["a red circle", "a blue square"], prompt_indices=[0, 1], **params.generate_kwargs(1))
    assert traj.window_size == 1 and torch.isnan(traj.log_probs).all()
    assert torch.equal(traj.sigmas[:, -1], torch.zeros(8))  # the recorded step ends at the clean sample

    rewards = sign * torch.tensor([0.1, 0.9, 0.5, 0.2, 0.3, 0.8, 0.4, 0.6])  # samples 0-3: prompt 0; 4-7: prompt 1
    order, pair_rewards = preference_pairs(rewards, torch.zeros(8, dtype=torch.bool), torch.tensor([0] * 4 + [1] * 4))
    assert order.tolist() == ([1, 0, 5, 4] if sign > 0 else [0, 1, 4, 5])
    pairs = traj.index_select(order)
    before = _flow_matching_error(trainer, pairs)
    metrics = trainer.train_on(pairs, pair_rewards, 1)
    assert metrics["actor/dpo_loss"] == pytest.approx(torch.log(torch.tensor(2.0)).item(), abs=1e-6)
    assert metrics["actor/implicit_acc"] == 0.0 and metrics["actor/dpo_tied_pairs"] == 0.0
    change = _flow_matching_error(trainer, pairs) - before
    assert (change[0::2] - change[1::2]).mean() < 0, change  # the chosen samples are fitted relative to the rejected


def test_a_dpo_step_whose_pairs_all_tie_leaves_the_weights_as_they_were(tiny_sd3_dir, one_torch_thread):
    """Every pair of the step tied (a reward of few values): no update at all (AdamW's momentum and weight decay would move
    the weights with no signal); the step counts as trained, and the next step with a preference trains."""
    trainer = _trainer(tiny_sd3_dir, *DIFFUSION_DPO, "actor_rollout_ref.actor.optim.weight_decay=0.1")
    params = SamplingParams.for_training(trainer.config.actor_rollout_ref.rollout, "dpo")
    traj = generate(trainer.policy, ["a red circle", "a blue square"], prompt_indices=[0, 1], **params.generate_kwargs(1))
    pairs = traj.index_select(torch.tensor([0, 1, 4, 5]))
    before = {k: v.detach().clone() for k, v in trainer.trainable_state().items()}
    lr_before = trainer.lr_scheduler.last_epoch
    metrics = trainer.train_on(pairs, torch.tensor([1.0, 1.0, 0.5, 0.5]), 1)
    assert metrics["actor/dpo_tied_pairs"] == 1.0 and metrics["actor/dpo_idle_step"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in trainer.trainable_state().items()) and trainer.version == 1
    assert trainer.lr_scheduler.last_epoch == lr_before + 1  # the schedule moves on as after any step
    metrics = trainer.train_on(pairs, torch.tensor([1.0, 0.0, 0.5, 0.5]), 2)  # one pair with a preference
    assert "actor/dpo_idle_step" not in metrics and metrics["actor/dpo_tied_pairs"] == 0.5
    assert not all(torch.equal(before[k], v) for k, v in trainer.trainable_state().items())


def test_a_filtered_step_trains_its_kept_groups_in_as_many_mini_batches_as_the_full_step(tiny_sd3_dir, one_torch_thread):
    """algorithm.filter_zero_std_groups: the controller passes the kept groups only. The update keeps the number of
    mini-batches (data.train_batch_size / ppo_mini_batch_size = 4 / 2) and shrinks them: two kept groups of 4 samples
    train in 2 mini-batches of 4, the two optimizer steps of a run whose batch is those 2 prompts (ppo_mini_batch_size
    1), bit for bit. Mini-batches of the unfiltered size (8 samples) would make one step. A step that keeps nothing
    makes no update and moves the LR schedule on."""
    micro = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"
    filtered = _trainer(tiny_sd3_dir, micro, "data.train_batch_size=4", "algorithm.filter_zero_std_groups=true")
    reference = _trainer(tiny_sd3_dir, micro, "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=1")
    traj = _rollout(filtered, 1)  # 2 prompts x 4 samples: the groups the filter kept of the step's 4
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5] * 2)
    assert filtered.update_config(1, batch_size=8).mini_batch_size == 4 == reference.update_config(1).mini_batch_size
    filtered.train_on(traj, advantages, 1)
    reference.train_on(traj, advantages, 1)
    for name, value in reference.trainable_state().items():
        assert torch.equal(filtered.trainable_state()[name], value), name

    before = {k: v.detach().clone() for k, v in filtered.trainable_state().items()}
    lr_before = filtered.lr_scheduler.last_epoch
    metrics = filtered.train_on(None, torch.zeros(0), 2)
    assert metrics["actor/zero_std_idle_step"] == 1.0 and filtered.version == 2
    assert all(torch.equal(before[k], v) for k, v in filtered.trainable_state().items())
    assert filtered.lr_scheduler.last_epoch == lr_before + 1


def test_an_online_dpo_trainer_resumed_from_its_state_trains_the_next_step_bit_for_bit(tiny_sd3_dir, one_torch_thread):
    """Three DPO steps in one go against two steps, the state dict, a fresh trainer and the third: the same weights bit
    for bit (each pair's noise and training-schedule point are seeded by the step and the pair, not drawn from a
    stream that a restart would reset)."""
    from omni_core.algorithms.diffusion_dpo import preference_pairs

    extra = [*DIFFUSION_DPO, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]
    params = SamplingParams.for_training(_trainer(tiny_sd3_dir, *extra).config.actor_rollout_ref.rollout, "dpo")
    rewards, groups = torch.tensor([0.1, 0.9, 0.5, 0.2, 0.3, 0.8, 0.4, 0.6]), torch.tensor([0] * 4 + [1] * 4)

    def step(trainer: PolicyTrainer, s: int) -> None:
        traj = generate(trainer.policy, ["a red circle", "a blue square"], prompt_indices=[0, 1], **params.generate_kwargs(s))
        order, pair_rewards = preference_pairs(rewards, torch.zeros(8, dtype=torch.bool), groups)
        trainer.train_on(traj.index_select(order), pair_rewards, s)

    whole = _trainer(tiny_sd3_dir, *extra)
    step(whole, 1)
    step(whole, 2)
    saved = copy.deepcopy(whole.state_dict())
    step(whole, 3)
    resumed = _trainer(tiny_sd3_dir, *extra)
    resumed.load_state_dict(saved)
    step(resumed, 3)
    a, b = whole.state_dict()["model"], resumed.state_dict()["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], saved["model"][k]) for k in a)  # the third step trained


def test_the_old_policy_is_swapped_in_and_back_bit_for_bit_and_saved_with_the_state(tiny_sd3_dir, one_torch_thread):
    trainer = _trainer(tiny_sd3_dir, *NFT, "algorithm.old_policy_decay=0.5")
    live = trainer.trainable_state()
    trained = {k: v.detach().clone() for k, v in live.items()}
    old = {k: v + 1.0 for k, v in trained.items()}  # an old policy that differs from the trained one
    trainer.old_policy = {k: v.clone() for k, v in old.items()}
    with trainer.old_policy_loaded():
        assert all(torch.equal(live[k], old[k]) for k in live)
        with pytest.raises(RuntimeError, match="does not nest"), trainer.old_policy_loaded():
            pass
    assert all(torch.equal(live[k], trained[k]) for k in live)
    metrics = trainer.refresh_old_policy(3)  # decay 0.5: the mean of the two
    assert metrics == {"actor/old_policy_refreshed": 1.0, "actor/old_policy_decay": 0.5}
    assert all(torch.allclose(trainer.old_policy[k], trained[k] + 0.5, atol=1e-6) for k in live)
    state = copy.deepcopy(trainer.state_dict())
    fresh = _trainer(tiny_sd3_dir, *NFT)
    fresh.load_state_dict(state)
    assert all(torch.equal(fresh.old_policy[k], trainer.old_policy[k]) for k in live)


def test_a_diffusion_nft_trainer_resumed_from_its_state_trains_the_next_step_bit_for_bit(tiny_sd3_dir, one_torch_thread):
    """Three steps in one go against two steps, the state dict, a fresh trainer and the third: the same weights and old
    policy, bit for bit. With a decay of 0.5 the old policy is not the trained one, so the third step's rollout (sampled
    with it) and its old predictions need the saved old policy; its timestep subsets and forward noise are seeded by
    the step."""
    extra = [*NFT, "algorithm.old_policy_decay=0.5", "algorithm.timestep_fraction=0.5"]
    params = SamplingParams.for_training(_trainer(tiny_sd3_dir, *extra).config.actor_rollout_ref.rollout, "diffusion_nft")

    def step(trainer: PolicyTrainer, s: int) -> None:
        with trainer.old_policy_loaded():  # the rollout samples with the old policy (rollout_adapter=old)
            traj = generate(trainer.policy, ["a red circle", "a blue square"], prompt_indices=[0, 1], **params.generate_kwargs(s))
        trainer.train_on(traj, torch.tensor([1.0, -1.0, 0.5, -0.5] * 2), s)

    whole = _trainer(tiny_sd3_dir, *extra)
    step(whole, 1)
    step(whole, 2)
    saved = copy.deepcopy(whole.state_dict())
    assert not all(torch.equal(saved["old_policy"][k], saved["model"][k]) for k in saved["model"])  # old != trained
    step(whole, 3)
    resumed = _trainer(tiny_sd3_dir, *extra)
    resumed.load_state_dict(saved)
    step(resumed, 3)
    for name in ("model", "old_policy"):
        a, b = whole.state_dict()[name], resumed.state_dict()[name]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.parametrize("cfg", [[], ["actor_rollout_ref.rollout.pipeline.guidance_scale=4.0"]], ids=["no_cfg", "cfg"])
def test_window_steps_in_one_forward_give_the_per_step_numbers_and_a_first_ratio_of_exactly_one(tiny_sd3_dir, one_torch_thread, cfg):
    """`actor.window_steps_per_forward=2` (a window of 3: steps [0, 1] in one forward, then [2]): the stacked forward's
    log-probs, means and velocities equal one forward per step to fp32 rounding; the old-log-prob pass stacks the
    same steps, so the first ratio is exactly 1; one update moves the weights as the per-step update does, to
    rounding (the losses of a chunk are summed before one backward)."""
    from omni_core.rollout.sampler import score_transitions, score_window_steps

    window = ["actor_rollout_ref.rollout.algo.sde_window_size=3", *cfg]
    per_step = _trainer(tiny_sd3_dir, *window)
    stacked = _trainer(tiny_sd3_dir, *window, "actor_rollout_ref.actor.window_steps_per_forward=2")
    assert stacked.window_chunks(3) == [[0, 1], [2]]
    traj = _rollout(per_step, 1)
    assert traj.window_size == 3
    kwargs = {"guidance_scale": per_step.config.actor_rollout_ref.rollout.pipeline.guidance_scale, "noise_level": 0.7}
    with torch.no_grad():
        together = score_window_steps(per_step.policy, traj, [0, 1, 2], **kwargs)
        for j, scored in enumerate(together):
            alone = score_transitions(per_step.policy, traj, j, **kwargs)
            for got, want in zip(scored, alone, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    advantages = torch.tensor([1.0, -1.0] * 4)
    torch.testing.assert_close(stacked.old_log_probs(traj), per_step.old_log_probs(traj), rtol=1e-5, atol=1e-5)
    # Plain SGD with lr 1 on both, so each weight moves by its (clipped) gradient: the update compares element by
    # element. (Adam's first step is lr x sign(g), which rounding flips wherever a gradient is near zero.)
    before = {}
    for name, t in (("stacked", stacked), ("per_step", per_step)):
        params = [q for q in t.policy.transformer.parameters() if q.requires_grad]
        t.optimizer = torch.optim.SGD(params, lr=1.0)
        before[name] = [q.detach().clone() for q in params]
    m_stacked = stacked.train_on(traj, advantages, 1)
    m_per_step = per_step.train_on(traj, advantages, 1)
    assert m_stacked["actor/ratio_mean"] == 1.0 and m_stacked["actor/ratio_std"] == 0.0
    assert m_stacked["actor/pg_loss"] == pytest.approx(m_per_step["actor/pg_loss"], rel=1e-5, abs=1e-7)
    after = {name: [q.detach() for q in t.policy.transformer.parameters() if q.requires_grad] for name, t in (("stacked", stacked), ("per_step", per_step))}
    moved_stacked = [a - b for a, b in zip(after["stacked"], before["stacked"], strict=True)]
    moved_per_step = [a - b for a, b in zip(after["per_step"], before["per_step"], strict=True)]
    scale = max(float(d.abs().max()) for d in moved_per_step)
    assert scale > 0  # the update moved the weights, so the comparison below means something
    for got, want in zip(moved_stacked, moved_per_step, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale)
