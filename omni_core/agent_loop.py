"""The agent-loop manager: `rollout.agent.num_workers` rollout workers as named Ray actors.

It dispatches a rollout request across the workers without waiting (verl's fire-and-forget
`generate_sequences`; the trainer waits on the TransferQueue through the replay buffer), pushes
weights to them, and checks that they are alive: a worker that died or raised surfaces with its
traceback the next time the replay buffer polls, instead of a wait that never ends.

The actors are created once from the flow process (`create`), found again by name from a `fit_epoch`
task on any Ray worker (`attach`), and stopped by `close`.
"""

from __future__ import annotations

from typing import Any

import ray

from omni_core.records import LogLine, WorkerNames
from omni_core.rollout.request import RolloutRequest


class AgentLoopManager:
    """Handles to the rollout workers plus the in-flight requests of this process."""

    def __init__(self, workers: list[Any], names: WorkerNames):
        self.workers = workers
        self.names = names
        self._inflight: list[ray.ObjectRef] = []
        self._logs: list[LogLine] = []

    @classmethod
    def create(
        cls,
        config: dict[str, Any],
        names: WorkerNames,
        options: list[dict[str, Any]],
        num_threads: int,
        prompt_embeddings: str | None = None,
        max_restarts: int = 3,
    ) -> AgentLoopManager:
        """Start one rollout worker per entry of `options` (its Ray resources and placement; see
        `omni_core.worker_pool.actor_options`), from the flow process, so they outlive any one task."""
        from omni_core.workers.rollout_worker import RolloutWorker  # diffusers: only where workers start

        remote = ray.remote(RolloutWorker)
        workers = [
            remote.options(name=names.rollout_worker(i), namespace=names.namespace, max_restarts=max_restarts, **opts).remote(
                config, i, num_threads, prompt_embeddings
            )
            for i, opts in enumerate(options)
        ]
        ray.get([w.ping.remote() for w in workers], timeout=600)
        return cls(workers, names)

    @classmethod
    def attach(cls, names: WorkerNames, num_workers: int) -> AgentLoopManager:
        workers = [ray.get_actor(names.rollout_worker(i), namespace=names.namespace) for i in range(num_workers)]
        return cls(workers, names)

    def generate_sequences(self, request: RolloutRequest, chunk_size: int | None = None) -> None:
        """Dispatch the request (non-blocking): one contiguous part per worker, or chunks of at most
        `chunk_size` prompts dealt round-robin (`data.gen_batch_size` / `data.val_batch_size`)."""
        for worker, calls in zip(self.workers, request.assign(len(self.workers), chunk_size), strict=True):
            self._inflight.extend(worker.generate.remote(part) for part in calls)

    def check_alive(self) -> None:
        """Raise if a dispatched request failed (worker died or raised); collect finished results' logs."""
        if not self._inflight:
            return
        done, self._inflight = ray.wait(self._inflight, num_returns=len(self._inflight), timeout=0)
        for ref in done:
            result = ray.get(ref)  # re-raises the worker's exception with its traceback
            self._logs.extend(result.logs)

    def drain_logs(self) -> list[LogLine]:
        """Log lines of the requests that finished since the last call."""
        self.check_alive()
        lines, self._logs = self._logs, []
        return lines

    def update_weights(self, weights: Any, version: int, timeout_s: float = 600) -> None:
        """Push the trained weights (an ObjectRef or a state dict) to every rollout worker."""
        ray.get([w.set_weights.remote(weights, version) for w in self.workers], timeout=timeout_s)

    def close(self) -> None:
        """Stop the rollout workers (Ray does not restart them)."""
        for w in self.workers:
            ray.kill(w, no_restart=True)
