"""`PolicyTrainer` in-process on the tiny SD3 model (no Ray, no TransferQueue): the update's sign, the first ratio,
what the loss declares, state dicts, and that the module needs neither Ray nor the TransferQueue."""

from __future__ import annotations

import ast
import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from flow_utils import SMALL_ACTOR_STEP

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
