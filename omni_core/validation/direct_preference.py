"""The direct-preference family (verl-omni's `algorithm.trainer_type=direct_preference`): DiffusionNFT's and online
Diffusion-DPO's keys and what each cannot be combined with. (Offline samples, offline Diffusion-DPO's pairs data set,
are `omni_core.validation.offline_samples`.)

Each is selected by verl-omni's keys together: `model.algorithm` (its rollout: the ODE over the whole schedule, no
log-probs), `model.model_type` (its engine), `diffusion_loss.loss_mode` and `algorithm.trainer_type=direct_preference`;
DiffusionNFT's old policy is `model.policy_state_adapters=[default,old]` with `rollout.rollout_adapter=old`, and
Diffusion-DPO's pairs are `algorithm.paired_preference=true`, as verl-omni requires.
"""

from __future__ import annotations

from omni_core.config import ConfigProblem, OmniFlowConfig
from omni_core.config.algorithm_names import FORWARD_PROCESS_ALGORITHMS, FORWARD_PROCESS_LOSSES, PAIRED_LOSSES
from omni_core.validation.refused import config_value, default_config

# algorithm keys only DiffusionNFT reads.
NFT_ALGORITHM_KEYS = (
    "timestep_fraction",
    "adv_mode",
    "old_policy_decay_schedule",
    "old_policy_decay",
    "old_policy_update_interval",
)
# What a policy-gradient run trains instead of a fraction of the steps (DanceGRPO's own code calls it timestep_fraction).
TRAINED_STEPS = (
    " (a policy-gradient run, DanceGRPO included, trains the steps of each sample's SDE window: "
    "actor_rollout_ref.rollout.algo.sde_window_size of rollout.pipeline.num_inference_steps)"
)
# rollout.algo keys of the SDE sampler, which the forward-process algorithms' ODE rollout does not use.
SDE_KEYS = ("noise_level", "sde_type", "sde_window_size", "sde_window_range", "init_same_noise")
ADAPTER_SETS = (("default",), ("default", "old"))
NAMES = {"diffusion_nft": "DiffusionNFT", "dpo": "Diffusion-DPO"}


def direct_preference_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    p: list[ConfigProblem] = []
    arr, algo = config.actor_rollout_ref, config.algorithm
    model, loss_mode = arr.model, arr.actor.diffusion_loss.loss_mode
    expected_loss = FORWARD_PROCESS_LOSSES.get(model.algorithm)
    forward_loss = loss_mode in FORWARD_PROCESS_LOSSES.values()
    if (expected_loss is not None or forward_loss) and expected_loss != loss_mode:
        if expected_loss is not None:
            key, value = "actor_rollout_ref.actor.diffusion_loss.loss_mode", loss_mode
            why = (
                f"actor_rollout_ref.model.algorithm={model.algorithm} is {NAMES[model.algorithm]}'s rollout (the ODE over "
                f"every step, no log-probs), which only its loss trains on: set loss_mode={expected_loss}"
            )
        else:
            algorithm = next(a for a, loss in FORWARD_PROCESS_LOSSES.items() if loss == loss_mode)
            key, value = "actor_rollout_ref.model.algorithm", model.algorithm
            why = (
                f"loss_mode={loss_mode} ({NAMES[algorithm]}) trains on the final samples of its own rollout (the ODE over "
                f"every step, no log-probs): set actor_rollout_ref.model.algorithm={algorithm} with it"
            )
        return [ConfigProblem(key, why, value)]  # the keys below follow from these two
    if forward_loss and arr.actor.window_steps_per_forward > 1:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.actor.window_steps_per_forward",
                f"stacks the SDE window steps of a micro-batch in one forward; loss_mode={loss_mode} trains on "
                "forward-process points of the final samples, one per step: remove the key (1)",
                arr.actor.window_steps_per_forward,
            )
        )
    model_type, trainer_type = FORWARD_PROCESS_ALGORITHMS.get(model.algorithm, ("diffusion_model", "policy_gradient"))
    if model.model_type != model_type:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.model.model_type",
                f"must be {model_type} with actor_rollout_ref.model.algorithm={model.algorithm} (verl-omni's engine of it)",
                model.model_type,
            )
        )
    if algo.trainer_type != trainer_type:
        p.append(
            ConfigProblem(
                "algorithm.trainer_type",
                f"must be {trainer_type} with actor_rollout_ref.model.algorithm={model.algorithm} (direct_preference is "
                "the loop of DiffusionNFT and Diffusion-DPO)",
                algo.trainer_type,
            )
        )
    paired = loss_mode in PAIRED_LOSSES
    if algo.paired_preference != paired:
        why = (
            "Diffusion-DPO trains on each prompt group's (chosen, rejected) pair: set it to true"
            if paired
            else f"pairs (chosen, rejected) samples for Diffusion-DPO (loss_mode=dpo), which loss_mode={loss_mode} is not; "
            "set it to false"
        )
        p.append(ConfigProblem("algorithm.paired_preference", why, algo.paired_preference))
    nft = model.algorithm == "diffusion_nft"
    p += _adapter_problems(config, nft)
    if not nft:
        defaults = default_config().algorithm
        p += [
            ConfigProblem(
                f"algorithm.{key}",
                "is read only by DiffusionNFT (actor_rollout_ref.model.algorithm=diffusion_nft), as in verl-omni; drop the "
                "key" + (TRAINED_STEPS if key == "timestep_fraction" else ""),
                getattr(algo, key),
            )
            for key in NFT_ALGORITHM_KEYS
            if getattr(algo, key) != getattr(defaults, key)
        ]
    if expected_loss is None:
        return p
    p += _ode_rollout_problems(config, NAMES[model.algorithm])
    p += _nft_placement_problems(config) if nft else _dpo_mode_problems(config)
    return p


def _adapter_problems(config: OmniFlowConfig, nft: bool) -> list[ConfigProblem]:
    """`model.policy_state_adapters` and `rollout.rollout_adapter`: the old policy is DiffusionNFT's, on a LoRA adapter."""
    arr = config.actor_rollout_ref
    adapters, rollout_adapter = tuple(arr.model.policy_state_adapters), arr.rollout.rollout_adapter
    key = "actor_rollout_ref.model.policy_state_adapters"
    if adapters not in ADAPTER_SETS:
        return [ConfigProblem(key, "must be [default] or [default, old] (DiffusionNFT's old policy)", list(adapters))]
    has_old = "old" in adapters
    if nft and not has_old:
        return [ConfigProblem(key, "DiffusionNFT keeps an old policy next to the trained one: set [default,old]", list(adapters))]
    if has_old and not nft:
        message = "the old policy is read only by DiffusionNFT (loss_mode=diffusion_nft); set [default]"
        return [ConfigProblem(key, message, list(adapters))]
    p: list[ConfigProblem] = []
    if has_old and arr.model.lora_rank <= 0:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.model.lora_rank",
                "the old policy is a second LoRA adapter (as verl-omni's): set lora_rank > 0 with policy_state_adapters "
                "[default,old]",
                arr.model.lora_rank,
            )
        )
    if has_old and rollout_adapter != "old":
        p.append(
            ConfigProblem(
                "actor_rollout_ref.rollout.rollout_adapter",
                "with an old policy the rollouts sample with it (verl-omni's requirement): set old",
                rollout_adapter,
            )
        )
    elif rollout_adapter == "old" and not has_old:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.rollout.rollout_adapter",
                "samples with the old policy, which needs actor_rollout_ref.model.policy_state_adapters=[default,old]",
                rollout_adapter,
            )
        )
    return p


def _ode_rollout_problems(config: OmniFlowConfig, name: str) -> list[ConfigProblem]:
    """What an algorithm with the ODE rollout (`name`: DiffusionNFT, Diffusion-DPO) cannot be combined with: the SDE
    sampler's keys, and the log-prob based corrections and penalties."""
    arr, algo = config.actor_rollout_ref, config.algorithm
    p: list[ConfigProblem] = []
    sde_defaults = default_config().actor_rollout_ref.rollout.algo
    for key in SDE_KEYS:
        value = getattr(arr.rollout.algo, key)
        if value != getattr(sde_defaults, key):
            p.append(
                ConfigProblem(
                    f"actor_rollout_ref.rollout.algo.{key}",
                    f"configures the SDE sampler, and {name}'s rollout is the ODE over every step; drop the key",
                    list(value) if isinstance(value, tuple) else value,
                )
            )
    rc = algo.rollout_correction
    if rc.bypass_mode or rc.rollout_is is not None or rc.rollout_rs is not None:
        p.append(
            ConfigProblem(
                "algorithm.rollout_correction",
                f"corrects policy-gradient ratios with the rollout's log-probs; {name} has neither: drop its keys",
                {"bypass_mode": rc.bypass_mode, "rollout_is": rc.rollout_is, "rollout_rs": rc.rollout_rs},
            )
        )
    ref_micro = arr.ref.log_prob_micro_batch_size_per_gpu
    if ref_micro is not None and ref_micro != arr.actor.ppo_micro_batch_size_per_gpu:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                f"{name} computes the reference's velocity inside the update, at each micro-batch's forward-process point, "
                f"so it runs in actor.ppo_micro_batch_size_per_gpu={arr.actor.ppo_micro_batch_size_per_gpu} samples; set "
                "null or that value",
                ref_micro,
            )
        )
    if arr.actor.use_kl_loss:
        towards = (
            "actor_rollout_ref.actor.diffusion_loss.ref_kl_coef"
            if name == "DiffusionNFT"
            else "built into its loss (the reference's error in every term, weighted by dpo_beta)"
        )
        p.append(
            ConfigProblem(
                "actor_rollout_ref.actor.use_kl_loss",
                f"is the policy-gradient losses' KL penalty; {name}'s pull towards the reference is {towards}",
                True,
            )
        )
    return p


def _dpo_mode_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    """Online Diffusion-DPO trains each step's fresh pairs in sync mode."""
    mode = config.trainer.v1.trainer_mode
    if mode == "sync":
        return []
    return [
        ConfigProblem(
            "trainer.v1.trainer_mode",
            "online Diffusion-DPO runs in sync mode here: separate_async's staleness statistics are importance ratios of "
            "the rollout's log-probs, which DPO's ODE rollout does not record; set sync",
            mode,
        )
    ]


def _nft_placement_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    """DiffusionNFT samples with its old policy: (for now) not on rollout workers of their own, nor on sharded ranks."""
    from omni_core.resources import uses_hybrid_engine

    arr = config.actor_rollout_ref
    p: list[ConfigProblem] = []
    if arr.actor.strategy == "fsdp2":  # (no hybrid engine either: the problem is the shards)
        p.append(
            ConfigProblem(
                "actor_rollout_ref.actor.strategy",
                "DiffusionNFT's old policy is swapped in as whole tensors, which fsdp2's shards are not; use torch or ddp",
                arr.actor.strategy,
            )
        )
    elif config.trainer.v1.trainer_mode != "sync" or not uses_hybrid_engine(config):
        from omni_core.resources import hybrid_engine_obstacles

        obstacles = hybrid_engine_obstacles(config)
        key, why = obstacles[0] if obstacles else ("actor_rollout_ref.hybrid_engine", "it is set to false")
        p.append(
            ConfigProblem(
                key,
                f"DiffusionNFT samples with its old policy inside the training ranks (verl's hybrid engine, sync mode), "
                f"and here {why}; rollout workers of their own cannot hold the old policy yet",
                config_value(config, key),
            )
        )
    return p
