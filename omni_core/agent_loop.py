"""The agent-loop manager: `rollout.agent.num_workers` rollout workers as named Ray actors.

It dispatches a prompt batch across the workers without waiting (verl's fire-and-forget
`generate_sequences`; the trainer waits on the TransferQueue through the replay buffer), pushes
weights to them, and checks that they are alive: a worker that died or raised surfaces with its
traceback the next time the replay buffer polls, instead of a wait that never ends.

The actors are created once from the flow process (`create`) and found again by name from a
`fit_epoch` task on any Ray worker (`attach`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray

from omni_core.workers.rollout_worker import PromptItem, RolloutResult, RolloutWorker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerNames:
    """Where a run's actors live: the Ray namespace and one name per role."""

    namespace: str
    run_id: str

    @property
    def training_actor(self) -> str:
        return f"omniflow-{self.run_id}-training-actor"

    def rollout_worker(self, i: int) -> str:
        return f"omniflow-{self.run_id}-rollout-worker-{i}"


class AgentLoopManager:
    """Handles to the rollout workers plus the in-flight requests of this process."""

    def __init__(self, workers: list[Any], names: WorkerNames):
        self.workers = workers
        self.names = names
        self._inflight: list[ray.ObjectRef] = []
        self.results: list[RolloutResult] = []

    @classmethod
    def create(
        cls, config: dict[str, Any], names: WorkerNames, num_workers: int, num_threads: int, max_restarts: int = 3
    ) -> AgentLoopManager:
        """Start the rollout workers (from the flow process, so they outlive any one task)."""
        remote = ray.remote(RolloutWorker)
        workers = [
            remote.options(
                name=names.rollout_worker(i),
                namespace=names.namespace,
                num_cpus=1,
                max_restarts=max_restarts,
            ).remote(config, i, num_threads)
            for i in range(num_workers)
        ]
        ray.get([w.ping.remote() for w in workers], timeout=600)
        return cls(workers, names)

    @classmethod
    def attach(cls, names: WorkerNames, num_workers: int) -> AgentLoopManager:
        workers = [ray.get_actor(names.rollout_worker(i), namespace=names.namespace) for i in range(num_workers)]
        return cls(workers, names)

    def generate_sequences(self, partition: str, items: Sequence[PromptItem], global_step: int, validate: bool = False) -> None:
        """Split `items` into contiguous chunks, one per worker, and dispatch them (non-blocking)."""
        items = list(items)
        k = len(self.workers)
        chunks = [items[i * len(items) // k : (i + 1) * len(items) // k] for i in range(k)]
        for worker, chunk in zip(self.workers, chunks, strict=True):
            if chunk:
                self._inflight.append(worker.generate.remote(partition, chunk, global_step, validate))

    def check_alive(self) -> None:
        """Raise if a dispatched request failed (worker died or raised); collect finished results."""
        if not self._inflight:
            return
        done, self._inflight = ray.wait(self._inflight, num_returns=len(self._inflight), timeout=0)
        for ref in done:
            result: RolloutResult = ray.get(ref)  # re-raises the worker's exception with its traceback
            self.results.append(result)

    def drain_logs(self) -> list[str]:
        """Log lines of the finished requests since the last call."""
        self.check_alive()
        lines = [line for r in self.results for line in r.logs]
        self.results = []
        return lines

    def wait_all(self, timeout_s: float) -> None:
        """Wait (bounded) for every dispatched request."""
        if self._inflight:
            ray.get(self._inflight, timeout=timeout_s)
            self.check_alive()

    def update_weights(self, weights: Any, version: int, timeout_s: float = 600) -> None:
        """Push the trained weights (an ObjectRef or a state dict) to every rollout worker."""
        ray.get([w.set_weights.remote(weights, version) for w in self.workers], timeout=timeout_s)

    def versions(self) -> list[int]:
        return ray.get([w.get_version.remote() for w in self.workers], timeout=60)

    def kill(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
