"""The same omni_core components in one plain in-process loop: no Prefect, no Ray, no TransferQueue.

The baseline of the orchestration-overhead benchmark (`bench_flow.py`), and a quick way to try a
config's learning dynamics: `python benchmarks/plain_loop.py [key=value ...] --steps 20`.
One process: sample -> reward -> advantages -> old log-probs + PPO update, as the flow's step does, with the
flow's batching (one batch per prompt group) and thread counts (every core, in turn), so the rewards of every
step equal the flow's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from omni_core.algorithms.registry import compute_advantages
from omni_core.config import OmniFlowConfig, load_config
from omni_core.data.dataloader import PromptDataLoader
from omni_core.data.prompts import load_prompts
from omni_core.rewards.manager import RewardManager
from omni_core.rollout.sampler import generate_groups
from omni_core.rollout.sampling_params import SamplingParams
from omni_core.workers.training_actor import TrainingActor


def run_plain(config: OmniFlowConfig, steps: int) -> list[dict[str, float]]:
    """Train `steps` steps in this process; returns per-step metrics (reward mean, timings)."""
    torch.set_num_threads(os.cpu_count() or 1)
    data, rollout = config.data, config.actor_rollout_ref.rollout
    params = SamplingParams.for_training(rollout)
    records = load_prompts(data.train_files if isinstance(data.train_files, str) else list(data.train_files))
    loader = PromptDataLoader(records, data.train_batch_size, shuffle=data.shuffle, seed=data.seed)
    actor = TrainingActor(config.model_dump(mode="json"), steps, os.cpu_count() or 1, text_encoders=True)
    policy = actor.policy  # rollout and training share one model in-process (sync mode, staleness 0)
    rewards_fn = RewardManager(config.reward)
    out = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        batch = loader.next_batch()
        with torch.no_grad():
            # One batch per prompt group, as the flow's rollout workers sample (the same rows whatever the layout).
            traj = generate_groups(
                policy,
                [r.prompt for r in batch],
                prompt_indices=list(range(len(batch))),
                **params.generate_kwargs(step),
            )
        t1 = time.perf_counter()
        scored = rewards_fn.score(traj.images, [r.data_source for r in batch for _ in range(rollout.n)])
        adv = compute_advantages(config.algorithm, scored.scores, traj.prompt_index)
        metrics = actor.train_on(traj, adv, step)
        metrics.pop("_train_s")
        t2 = time.perf_counter()
        out.append(
            {
                "step": step,
                "reward_mean": scored.scores.mean().item(),
                "gen_s": t1 - t0,
                "update_s": t2 - t1,
                "step_s": t2 - t0,
                "images": traj.batch_size,
                **{k: v for k, v in metrics.items() if k.startswith(("actor/", "timing_s/"))},
            }
        )
        print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in out[-1].items()}), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--steps", type=int, default=10)
    ns = parser.parse_args(argv)
    run_plain(load_config(overrides=ns.overrides), ns.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
