"""`ColocatedRollout`: verl's hybrid engine, a training rank that is also a rollout worker.

It samples, scores and stores a request in the training process with the trained weights as they are now (no
push over Ray), on its own number of torch threads. Where that gives the same numbers as a rollout copy
(`rollout_shares_trained_weights`) the rollout worker is a view of the trained modules; else it keeps a
`rollout.dtype` copy, refreshed whenever the weights changed since it last sampled. A request for the EMA weights
(validation with `actor.ema`) swaps the average in for the duration (flow_grpo's copy_ema_to / copy_temp_to), and a
training request of DiffusionNFT with `rollout.rollout_adapter=old` the old policy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

from omni_core.config import OmniFlowConfig
from omni_core.models.placement import rollout_shares_trained_weights
from omni_core.rollout.request import RolloutRequest
from omni_core.workers.policy_trainer import PolicyTrainer
from omni_core.workers.rollout_worker import RolloutResult, RolloutWorker


class ColocatedRollout:
    """Rollout worker `rank` living in training rank `rank`, over the weights of `trainer`."""

    def __init__(
        self, config: OmniFlowConfig, rank: int, rollout_threads: int, training_threads: int, prompt_embeddings: str | None
    ) -> None:
        self.config, self.rank = config, rank
        self.rollout_threads, self.training_threads = rollout_threads, training_threads
        self.prompt_embeddings = prompt_embeddings
        self._worker: RolloutWorker | None = None  # made at the first `generate`
        self._version: int | None = None  # the weights version its own copy holds (None: to refresh)

    def invalidate(self) -> None:
        """The trained weights changed other than by a training step (a reset): refresh the copy before sampling."""
        self._version = None

    def generate(
        self, trainer: PolicyTrainer, request: RolloutRequest, weights: Callable[[], dict[str, torch.Tensor]]
    ) -> RolloutResult:
        """Sample, score and store `request` with `trainer`'s weights (`weights()`: the full trainable state, for a
        copy); see `RolloutWorker.generate`."""
        with self._ema_weights_loaded(trainer, request.weights_ema), self._old_policy_loaded(trainer, request.params.old_policy):
            worker = self._current(trainer, weights)
            transformer = trainer.policy.transformer
            was_training = transformer.training
            transformer.eval()
            torch.set_num_threads(self.rollout_threads)
            try:
                return worker.generate(replace(request, weights=None, weights_version=None, weights_ema=False))
            finally:
                torch.set_num_threads(self.training_threads)
                transformer.train(was_training)

    @contextlib.contextmanager
    def _ema_weights_loaded(self, trainer: PolicyTrainer, use_ema: bool) -> Iterator[None]:
        """Within (when `use_ema`): the policy holds the EMA weights; the trained weights are put back on exit, and
        the rollout copy refreshes either way."""
        if not use_ema:
            yield
            return
        if trainer.ema is None:
            raise RuntimeError("a request asked for the EMA weights but actor_rollout_ref.actor.ema.enable is false")
        trained = trainer.policy.state_dict_for_checkpoint()
        trainer.policy.load_trainable_state(trainer.ema.average)
        self._version = None
        try:
            yield
        finally:
            trainer.policy.load_trainable_state(trained)
            self._version = None

    @contextlib.contextmanager
    def _old_policy_loaded(self, trainer: PolicyTrainer, use_old: bool) -> Iterator[None]:
        """Within (when `use_old`, `rollout.rollout_adapter=old`): the policy holds DiffusionNFT's old policy; the rollout
        copy refreshes on entry and again after."""
        if not use_old:
            yield
            return
        with trainer.old_policy_loaded():
            self._version = None
            try:
                yield
            finally:
                self._version = None

    def _current(self, trainer: PolicyTrainer, weights: Callable[[], dict[str, torch.Tensor]]) -> RolloutWorker:
        """The rollout worker over the current weights: a view of the trained modules, or a refreshed copy."""
        if rollout_shares_trained_weights(self.config, self.prompt_embeddings):
            stale = self._worker is None or self._worker.policy.transformer is not trainer.policy.transformer
            if stale:  # the first call, or `PolicyTrainer.build` made new modules
                assert self.prompt_embeddings is not None
                view = trainer.policy.sampling_view(self.prompt_embeddings)
                if self.config.actor_rollout_ref.rollout.use_torch_compile:
                    view.enable_torch_compile()
                config = self.config.model_dump(mode="json")
                self._worker = RolloutWorker(config, self.rank, self.rollout_threads, policy=view, set_threads=False)
            return self._worker
        if self._worker is None:
            config = self.config.model_dump(mode="json")
            self._worker = RolloutWorker(config, self.rank, self.rollout_threads, self.prompt_embeddings, set_threads=False)
        if self._version != trainer.version:
            self._worker.set_weights(weights(), trainer.version)
            self._version = trainer.version
        return self._worker
