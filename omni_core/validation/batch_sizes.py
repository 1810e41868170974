"""Batch arithmetic: train / mini / micro batches and group size (verl-omni's trainer asserts)."""

from __future__ import annotations

from omni_core.config import ConfigProblem, OmniFlowConfig


def next_multiple(value: int, divisor: int) -> int:
    """The smallest multiple of `divisor` that is >= `value` (the "try N" of a divisibility error)."""
    return ((value + divisor - 1) // divisor) * divisor


def batch_size_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    p: list[ConfigProblem] = []
    data, actor, rollout = config.data, config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    tbs, mbs = data.train_batch_size, actor.ppo_mini_batch_size
    if tbs % mbs:
        p.append(
            ConfigProblem(
                "data.train_batch_size",
                f"must be divisible by actor_rollout_ref.actor.ppo_mini_batch_size={mbs}; try {next_multiple(tbs, mbs)}",
                tbs,
            )
        )
    # A prompt's samples in the update: rollout.n, or its (chosen, rejected) pair (algorithm.paired_preference).
    paired = config.algorithm.paired_preference
    per_prompt, per_prompt_name = (2, "2 (a pair)") if paired else (rollout.n, "rollout.n")
    mini_samples = mbs * per_prompt
    micro = actor.ppo_micro_batch_size_per_gpu
    ranks = config.trainer.n_gpus_per_node * config.trainer.nnodes
    if paired and micro % 2:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                "must be even with algorithm.paired_preference=true: a (chosen, rejected) pair is never split across "
                f"micro-batches; try {micro + 1}",
                micro,
            )
        )
    elif mini_samples % micro:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                f"must divide a mini-batch of ppo_mini_batch_size x {per_prompt_name} = {mbs} x {per_prompt} = "
                f"{mini_samples} samples",
                micro,
            )
        )
    elif mini_samples % (ranks * micro):
        p.append(
            ConfigProblem(
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                f"each of the {ranks} training ranks (trainer.n_gpus_per_node x trainer.nnodes) takes "
                f"{mini_samples}/{ranks} samples of a {mini_samples}-sample mini-batch (ppo_mini_batch_size x {per_prompt_name}), "
                f"in micro-batches of this size: that share must be a whole number of micro-batches; try "
                f"ppo_micro_batch_size_per_gpu={max(1, mini_samples // ranks)} or a mini-batch that is a multiple of "
                f"{ranks * micro} samples",
                micro,
            )
        )
    if data.gen_batch_size and tbs % data.gen_batch_size:
        p.append(ConfigProblem("data.gen_batch_size", f"must divide data.train_batch_size={tbs}", data.gen_batch_size))
    if rollout.n < 2 and config.algorithm.sample_source == "online":  # offline: a pair's two images
        p.append(
            ConfigProblem(
                "actor_rollout_ref.rollout.n",
                "GRPO needs at least 2 samples per prompt (a group of one has advantage 0 and teaches nothing), and "
                "Diffusion-DPO two to make a (chosen, rejected) pair; use n >= 2",
                rollout.n,
            )
        )
    return p
