"""The feed of offline samples (`algorithm.sample_source=offline`, verl-omni's offline Diffusion-DPO): each step's
batch is the next preference pairs of the data set, written to the TransferQueue by the controller itself.

There are no rollout workers and no weights to publish. A pair is one prompt group of two rows, in the row schema the
rollout workers write (`Trajectory.to_columns`), so the update reads them exactly as it reads online DPO's pairs:

| column | a pair's two rows (chosen, then rejected) |
|---|---|
| `latents` `[2, 1, *latent]` | the images' VAE latents (`prepare_pair_latents`), the "final latents" DPO noises |
| `cond.*` | the prompt's embeddings (`prepare_prompt_embeddings`), with CFG's negatives when the run guides |
| `images` `[2, 3, H, W]` uint8 | the images as encoded (resized to `rollout.pipeline.height` x `width`) |
| `rewards` | the pair's scores (`win_score`, `lose_score`): the pairing takes the higher as chosen, a tie trains nothing |
| `log_probs`, `timesteps` `[2, 0]`; `sigmas` `[2, 1]` | empty: no sampling, no SDE window |

A step's rows get the uids `<step>-<i>`, as a rollout request's would, and are cleared after the step like them.
"""

from __future__ import annotations

from typing import Any

import torch

from omni_core.data.preference_pairs import PreferencePair, collate_fn
from omni_core.models.architectures import BY_PIPELINE
from omni_core.models.pair_latents import PairLatents, load_image_pixels, pixels_to_uint8
from omni_core.models.prompt_embeddings import PromptEmbeddings
from omni_core.rollout.sampler import uses_cfg
from omni_core.rollout.trajectory import Trajectory
from omni_core.tq import client as tqc
from omni_core.tq.replay_buffer import SampledBatch
from omni_core.trainers.rollout_feed import RolloutFeed


class PreferenceDataFeed(RolloutFeed):
    """Offline samples: the data set's pairs, one prompt group of (chosen, rejected) each (module docstring)."""

    def sample(self, step: int, prompts: int | None = None) -> SampledBatch:
        trainer = self.trainer
        assert trainer.dataloader is not None
        pairs: list[Any] = trainer.dataloader.next_batch()
        uids = [f"{step:06d}-{i:04d}" for i in range(len(pairs))]
        traj, rewards = self.pair_rows(pairs)
        keys = [tqc.trajectory_key(uid, side) for uid in uids for side in (0, 1)]
        fields: dict[str, Any] = {"rewards": rewards, "failed": torch.zeros(len(keys), dtype=torch.bool), **traj.to_columns()}
        fields["data_source"] = [pair.data_source for pair in pairs for _ in (0, 1)]
        tags = [{"status": tqc.SUCCESS, "global_steps": step, "model_version": step - 1} for _ in keys]
        tqc.put_trajectories(trainer.run.train_partition, keys, fields, tags)
        return SampledBatch(prompt_uids=uids, trajectory_keys=sorted(keys))

    def pair_rows(self, pairs: list[PreferencePair]) -> tuple[Trajectory, torch.Tensor]:
        """The rows of `pairs` (chosen then rejected, pair by pair) and their rewards (the scores) `[2P]`."""
        run, rollout = self.trainer.run, self.config.actor_rollout_ref.rollout
        if run.pair_latents is None or run.prompt_embeddings is None:
            raise RuntimeError("offline samples need the run's pair latents and prompt embeddings (prepare_pair_latents)")
        samples = collate_fn(self.config.data.custom_cls.collate_fn)(pairs)  # chosen then rejected, pair by pair
        images = [image for _, image, _ in samples]
        latents = PairLatents(run.pair_latents)
        height, width = latents.size
        x0 = latents.latents(images)
        b = x0.shape[0]
        pipeline = rollout.pipeline
        embeddings = PromptEmbeddings(run.prompt_embeddings)
        prompts = [pair.prompt for pair, _, _ in samples]
        negatives = self._training_params().negative_prompts([pair.negative_prompt for pair, _, _ in samples])
        do_cfg = uses_cfg(BY_PIPELINE[embeddings.architecture], pipeline.guidance_scale, pipeline.true_cfg_scale, negatives)
        cond = embeddings.cond(prompts, negatives, do_cfg, "cpu")
        traj = Trajectory(
            latents=x0.unsqueeze(1),
            log_probs=torch.zeros(b, 0),
            timesteps=torch.zeros(b, 0),
            sigmas=torch.zeros(b, 1),
            sigma_max=torch.zeros(b),
            window_start=torch.zeros(b, dtype=torch.long),
            cond=cond,
            images=torch.cat([pixels_to_uint8(load_image_pixels(image, height, width)) for image in images]),
            prompts=prompts,
            sample_seeds=torch.zeros(b, dtype=torch.long),  # nothing is sampled
            prompt_index=torch.tensor([pair.index for pair, _, _ in samples]),
            sample_index=torch.tensor([0, 1] * len(pairs)),
        )
        return traj, torch.tensor([score for _, _, score in samples]).float()

    def publish_weights(self, step: int) -> None:
        """No rollout side to send weights to."""

    def after_step(self, step: int) -> None:
        """No rollout side to send weights to."""
