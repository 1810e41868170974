"""Trainer modes: a registered `trainer.v1.trainer_mode` (names from `omni_core.config.trainer_modes`, never the
trainers themselves, a layer above), and each mode's requirements (including which mode the
sampler's group refill, `trainer.v1.sampler.drop_incomplete_groups`, runs in and the keys it conflicts with)."""

from __future__ import annotations

from omni_core.config import ConfigProblem, OmniFlowConfig
from omni_core.config.trainer_modes import trainer_mode_names
from omni_core.config.unsupported import REFUSED_WHEN_NOT_DEFAULT

# What only separate_async reads: set in sync mode they would be accepted and ignored.
ASYNC_ONLY_KEYS = (
    "actor_rollout_ref.rollout.nnodes",
    "trainer.v1.separate_async.num_warmup_batches",
    "trainer.v1.separate_async.parameter_sync_step",
    "trainer.v1.sampler.max_off_policy_threshold",
    "trainer.v1.sampler.max_off_policy_strategy",
)


def trainer_mode_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    # trainer.use_v1=false and separate_async.sync_compatible away from its default are refused by the `refused`
    # group (REFUSED_WHEN_NOT_DEFAULT).
    p: list[ConfigProblem] = []
    mode = config.trainer.v1.trainer_mode
    modes = trainer_mode_names()
    if mode not in modes:
        p.append(ConfigProblem("trainer.v1.trainer_mode", f"unknown trainer mode; available: {', '.join(modes)}", mode))
    if mode == "separate_async":
        p.extend(_separate_async_problems(config))
    elif mode == "sync":
        p.extend(_async_keys_in_sync(config))
    p.extend(_group_refill_problems(config))
    p.extend(_hybrid_engine_problems(config))
    return p


def _hybrid_engine_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    """`actor_rollout_ref.hybrid_engine=true` where the rollout cannot run inside the training ranks (null picks
    separate rollout workers there by itself)."""
    from omni_core.resources import hybrid_engine_obstacles

    if config.actor_rollout_ref.hybrid_engine is not True:
        return []
    return [
        ConfigProblem(
            "actor_rollout_ref.hybrid_engine",
            f"{reason} ({key}); set actor_rollout_ref.hybrid_engine=false (separate rollout workers) or null",
            True,
        )
        for key, reason in hybrid_engine_obstacles(config)
    ]


def _group_refill_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    """`drop_incomplete_groups` (verl-omni: sync mode only, generation batches of one prompt, refill rounds a positive
    int, which the schema checks) and the keys it would leave doing nothing."""
    from omni_core.validation.refused import config_value, default_config

    sampler = config.trainer.v1.sampler
    rounds_key, ratio_key = "trainer.v1.sampler.max_incomplete_group_refill_rounds", "reward.max_failure_ratio"
    p: list[ConfigProblem] = []
    if not sampler.drop_incomplete_groups:
        if sampler.max_incomplete_group_refill_rounds != config_value(default_config(), rounds_key):
            p.append(
                ConfigProblem(
                    rounds_key,
                    "only trainer.v1.sampler.drop_incomplete_groups=true refills failed prompt groups; set it, or remove this key",
                    sampler.max_incomplete_group_refill_rounds,
                )
            )
        return p
    if config.trainer.v1.trainer_mode != "sync":
        p.append(
            ConfigProblem(
                "trainer.v1.sampler.drop_incomplete_groups",
                f"only trainer.v1.trainer_mode=sync supports it, as in verl-omni (trainer_mode={config.trainer.v1.trainer_mode} "
                "samples prompt groups ahead with older weights and never holds a step for one group, while a refill "
                "re-samples a failed group's prompt and waits for it within the step); use sync, or set it to false (a "
                "failed sample then gets advantage 0 and reward.max_failure_ratio bounds how many may fail)",
                True,
            )
        )
    if config.data.gen_batch_size not in (None, 1):
        p.append(
            ConfigProblem(
                "data.gen_batch_size",
                "trainer.v1.sampler.drop_incomplete_groups=true generates one prompt per rollout call (verl-omni warns and "
                "uses 1), so that a failed group is evicted and re-issued alone; set data.gen_batch_size=1 or leave it null, "
                "or set drop_incomplete_groups=false",
                config.data.gen_batch_size,
            )
        )
    if config.reward.max_failure_ratio != config_value(default_config(), ratio_key):
        p.append(
            ConfigProblem(
                ratio_key,
                "with trainer.v1.sampler.drop_incomplete_groups=true no failed sample is trained (its group is refilled or "
                "dropped), so this ratio would bound nothing; remove the key, or set drop_incomplete_groups=false to train "
                "failed samples at advantage 0 up to this share",
                config.reward.max_failure_ratio,
            )
        )
    return p


def _async_keys_in_sync(config: OmniFlowConfig) -> list[ConfigProblem]:
    from omni_core.validation.refused import config_value, default_config

    p = []
    for key in ASYNC_ONLY_KEYS:
        assert key not in REFUSED_WHEN_NOT_DEFAULT
        value = config_value(config, key)
        if value != config_value(default_config(), key):
            p.append(
                ConfigProblem(
                    key,
                    "only trainer.v1.trainer_mode=separate_async uses it (sync mode samples every step with the current "
                    "weights on the training devices: on-policy, no standalone pool); set the mode or remove the key",
                    value,
                )
            )
    return p


def _separate_async_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    """verl-omni's asserts for the mode plus what OmniFlow's version of it needs."""
    p: list[ConfigProblem] = []
    sa, sampler = config.trainer.v1.separate_async, config.trainer.v1.sampler
    tbs, mbs = config.data.train_batch_size, config.actor_rollout_ref.actor.ppo_mini_batch_size
    rollout = config.actor_rollout_ref.rollout
    if tbs % sa.parameter_sync_step:
        p.append(
            ConfigProblem(
                "data.train_batch_size",
                f"must be divisible by trainer.v1.separate_async.parameter_sync_step={sa.parameter_sync_step} in separate_async mode",
                tbs,
            )
        )
    if tbs != mbs:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.actor.ppo_mini_batch_size",
                f"must equal data.train_batch_size={tbs} in separate_async mode (one update per sampled batch)",
                mbs,
            )
        )
    # Each global step runs parameter_sync_step local updates, each one mini-batch of train_batch_size /
    # parameter_sync_step prompt groups (verl-omni's step), split into micro-batches over the training ranks.
    arr = config.actor_rollout_ref
    micro, ranks = arr.actor.ppo_micro_batch_size_per_gpu, _training_ranks(config)
    local = tbs // sa.parameter_sync_step * arr.rollout.n
    if tbs % sa.parameter_sync_step == 0 and tbs == mbs and local % (micro * ranks):
        p.append(
            ConfigProblem(
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                f"each of a step's parameter_sync_step={sa.parameter_sync_step} local updates trains train_batch_size / "
                f"parameter_sync_step x rollout.n = {local} samples, which {ranks} training rank(s) must split into "
                f"micro-batches of this size; choose a divisor of {local // ranks if local % ranks == 0 else local}",
                micro,
            )
        )
    if rollout.nnodes <= 0 or rollout.n_gpus_per_node <= 0:
        key, value = (
            ("actor_rollout_ref.rollout.nnodes", rollout.nnodes)
            if rollout.nnodes <= 0
            else (
                "actor_rollout_ref.rollout.n_gpus_per_node",
                rollout.n_gpus_per_node,
            )
        )
        p.append(
            ConfigProblem(
                key,
                "separate_async samples on a standalone rollout pool of actor_rollout_ref.rollout.nnodes x n_gpus_per_node "
                "devices (on cpu: worker processes); set both >= 1, e.g. actor_rollout_ref.rollout.nnodes=1",
                value,
            )
        )
    pool = max(0, rollout.nnodes) * max(0, rollout.n_gpus_per_node)
    if pool and rollout.agent.num_workers not in (1, pool):
        p.append(
            ConfigProblem(
                "actor_rollout_ref.rollout.agent.num_workers",
                f"separate_async runs one rollout worker per device of the standalone pool (rollout.nnodes x "
                f"n_gpus_per_node = {pool}); leave num_workers at 1 or set it to {pool}",
                rollout.agent.num_workers,
            )
        )
    # Requests are put num_warmup_batches steps ahead, with the weights of the last sync: the schedule alone trains
    # groups up to warmup + sync - 1 model versions stale, each at span warmup + 1 (omni_core.rollout.staleness).
    worst = sa.num_warmup_batches + sa.parameter_sync_step - 1
    span = sa.num_warmup_batches + 1
    bypass = config.algorithm.rollout_correction.bypass_mode
    if worst > 0 and (not bypass or not rollout.calculate_log_probs):
        p.append(
            ConfigProblem(
                "algorithm.rollout_correction.bypass_mode",
                f"this schedule trains samples up to {worst:g} model versions stale, each against the log-probs of the weights "
                "that sampled it (the importance ratio); recomputing them with the current weights would hide that. Set "
                "algorithm.rollout_correction.bypass_mode=true with actor_rollout_ref.rollout.calculate_log_probs=true (or "
                "train on-policy: num_warmup_batches=0, parameter_sync_step=1)",
                bypass,
            )
        )
    if sampler.max_off_policy_threshold < span:
        p.append(
            ConfigProblem(
                "trainer.v1.sampler.max_off_policy_threshold",
                f"below the span the schedule itself produces: batches are put num_warmup_batches={sa.num_warmup_batches} "
                f"steps ahead, so each group is trained {span} global steps after its prompt was submitted (verl's unit: "
                "steps since submission, counting the training step) and would be dropped (or waited for forever); set "
                f"it >= {span} or lower num_warmup_batches",
                sampler.max_off_policy_threshold,
            )
        )
    return p


def _training_ranks(config: OmniFlowConfig) -> int:
    """The data-parallel training ranks (ddp / fsdp2: one per device; torch: one)."""
    t = config.trainer
    return t.n_gpus_per_node * t.nnodes if config.actor_rollout_ref.actor.strategy in ("ddp", "fsdp2") else 1
