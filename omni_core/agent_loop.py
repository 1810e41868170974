"""The agent-loop manager: `rollout.agent.num_workers` rollout workers as named Ray actors.

It dispatches a rollout request across the workers without waiting (verl's fire-and-forget
`generate_sequences`; the trainer waits on the TransferQueue through the replay buffer), pushes
weights to them, and checks that they are alive: a worker that died or raised surfaces with its
traceback the next time the replay buffer polls, instead of a wait that never ends.

The actors are started once from the flow process (`start`, then `wait_ready`), found again by name from a `fit_epoch`
task on any Ray worker (`attach`), and stopped by `close`. With verl's hybrid engine (`colocated`) the workers are the
training ranks themselves (`TrainingActor.generate`): nothing is started, pushed or stopped here.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray

from omni_core.records import LogLine, WorkerNames
from omni_core.rollout.request import RolloutRequest

# torch threads of each rollout worker when it samples alongside training (separate_async: a standalone worker
# per core). CPU kernels round differently per thread count (measured, torch 2.13 CPU on 2 cores: the VAE decode
# differs between 1 and 2 threads by up to 9e-7, enough to flip uint8 pixels and so the JPEG rewards; the tiny
# transformer's velocity between 1 and 3 threads), so the count never follows the worker count: the same request
# gives the same trajectories from one worker or several.
ROLLOUT_WORKER_THREADS = 1


def rollout_threads(standalone: bool) -> int:
    """torch threads of every rollout worker. separate_async (`standalone`): `ROLLOUT_WORKER_THREADS`, since the
    workers sample while the training ranks take the other cores. sync: the rollout and the update take turns
    (colocated, as verl's hybrid engine), so each worker gets every core of its node, whatever
    `rollout.agent.num_workers` is (the count must not follow the worker count, see above); with 1 thread the
    rollout of the main job took 2.2-2.9 s instead of 1.3-1.7 s per step on 2 cores (the plain loop, threads forced)."""
    return ROLLOUT_WORKER_THREADS if standalone else os.cpu_count() or 1


class AgentLoopManager:
    """Handles to the rollout workers plus the in-flight requests of this process."""

    def __init__(self, workers: list[Any], names: WorkerNames, colocated: bool = False):
        self.workers = workers
        self.names = names
        self.colocated = colocated  # the workers are the training ranks (hybrid engine), which own their weights
        self._inflight: list[ray.ObjectRef] = []
        self._worker_of: dict[ray.ObjectRef, int] = {}  # in-flight request -> index of the worker running it
        self._logs: list[LogLine] = []
        self.busy_seconds = 0.0  # sampling time of the requests that finished so far (their workers' own clocks)
        # The last weights pushed (an ObjectRef or a state dict) and their version: a worker that Ray restarted
        # after its process died comes back with the base weights and gets them again before it samples.
        self._weights: tuple[Any, int] | None = None

    @classmethod
    def start(
        cls,
        config: dict[str, Any],
        names: WorkerNames,
        options: list[dict[str, Any]],
        num_threads: int = ROLLOUT_WORKER_THREADS,
        prompt_embeddings: str | None = None,
        max_restarts: int = 3,
    ) -> AgentLoopManager:
        """Start one rollout worker per entry of `options` (its Ray resources and placement; see
        `omni_core.distributed.worker_pool.actor_options`), from the flow process, so they outlive any one task, without
        waiting for them: their imports and model loads overlap the training ranks' (`wait_ready` waits).
        `num_threads` torch threads each: `rollout_threads`, never a count that follows the worker count."""
        from omni_core.workers.rollout_worker import RolloutWorker  # diffusers: only where workers start

        remote = ray.remote(RolloutWorker)
        # get_if_exists: a retried init_agent_loop reuses the workers its failed try started (they get the
        # current weights next) instead of failing on "name already taken".
        workers = [
            remote.options(
                name=names.rollout_worker(i), namespace=names.namespace, max_restarts=max_restarts, get_if_exists=True, **opts
            ).remote(config, i, num_threads, prompt_embeddings)
            for i, opts in enumerate(options)
        ]
        return cls(workers, names)

    @classmethod
    def in_training_ranks(cls, ranks: list[Any], names: WorkerNames) -> AgentLoopManager:
        """The hybrid engine's workers: rollout worker `i` is training rank `i` (`TrainingActor.generate`)."""
        return cls(list(ranks), names, colocated=True)

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Wait (bounded) until every worker has loaded its model and answers."""
        ray.get([w.ping.remote() for w in self.workers], timeout=timeout_s)

    @classmethod
    def attach(cls, names: WorkerNames, num_workers: int, colocated: bool = False) -> AgentLoopManager:
        """The run's workers by name (`colocated`: the training ranks')."""
        name = names.training_rank if colocated else names.rollout_worker
        workers = [ray.get_actor(name(i), namespace=names.namespace) for i in range(num_workers)]
        return cls(workers, names, colocated)

    def generate_sequences(self, request: RolloutRequest, chunk_size: int | None = None) -> list[ray.ObjectRef]:
        """Dispatch the request (non-blocking): one contiguous part per worker, or chunks of at most
        `chunk_size` prompts dealt round-robin (`data.gen_batch_size` / `data.val_batch_size`); returns the
        calls' refs (`wait_for` them)."""
        self._resync_restarted_workers()
        refs = []
        for i, (worker, calls) in enumerate(zip(self.workers, request.assign(len(self.workers), chunk_size), strict=True)):
            for part in calls:
                ref = worker.generate.remote(part)
                self._inflight.append(ref)
                self._worker_of[ref] = i
                refs.append(ref)
        return refs

    @staticmethod
    def wait_for(refs: list[ray.ObjectRef], timeout_s: float) -> None:
        """Block (no polling) until the rollout calls `refs` returned, failed or `timeout_s` passed; what they
        returned is collected by `check_alive`. A worker writes its rows before its call returns."""
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s, fetch_local=False)

    def queue_to_least_busy(self, request: RolloutRequest, chunk_size: int) -> None:
        """Dispatch the request (non-blocking) in chunks of `chunk_size` prompts, each to the worker with the
        fewest requests still queued or running (separate_async: a worker takes the next group once it is free;
        the result does not depend on which worker samples a chunk, since the request names its weights)."""
        self._resync_restarted_workers()
        for part in request.chunks(chunk_size):
            self._collect_finished()
            load = [0] * len(self.workers)
            for ref in self._inflight:
                load[self._worker_of[ref]] += 1
            i = min(range(len(self.workers)), key=lambda w: (load[w], w))
            ref = self.workers[i].generate.remote(part)
            self._inflight.append(ref)
            self._worker_of[ref] = i

    def check_alive(self) -> None:
        """Raise if a dispatched request failed (worker died or raised); collect finished results' logs."""
        self._collect_finished()

    def _collect_finished(self) -> None:
        if not self._inflight:
            return
        done, self._inflight = ray.wait(self._inflight, num_returns=len(self._inflight), timeout=0)
        for ref in done:
            self._worker_of.pop(ref, None)
            result = ray.get(ref)  # re-raises the worker's exception with its traceback
            self._logs.extend(result.logs)
            self.busy_seconds += result.seconds

    def wait_idle(self, timeout_s: float = 600) -> None:
        """Wait (bounded) until every request dispatched from this process has finished; raise as `check_alive`."""
        if self._inflight:
            ray.wait(self._inflight, num_returns=len(self._inflight), timeout=timeout_s)
        self.check_alive()
        if self._inflight:
            raise TimeoutError(f"{len(self._inflight)} rollout requests still running after {timeout_s:g}s")

    def drain_logs(self) -> list[LogLine]:
        """Log lines of the requests that finished since the last call."""
        self.check_alive()
        lines, self._logs = self._logs, []
        return lines

    def update_weights(self, weights: Any, version: int, timeout_s: float = 600) -> None:
        """Push the trained weights (an ObjectRef or a state dict) to every rollout worker (never called for
        `colocated` workers: they sample with the weights they train)."""
        self._weights = (weights, version)
        ray.get([w.set_weights.remote(weights, version) for w in self.workers], timeout=timeout_s)

    def _resync_restarted_workers(self, timeout_s: float = 600) -> None:
        """Give the last pushed weights again to a worker whose version differs (Ray restarted it after its
        process died: it reloaded the base model), so that no sample comes from the wrong weights."""
        if self._weights is None:
            return
        weights, version = self._weights
        versions = ray.get([w.get_version.remote() for w in self.workers], timeout=timeout_s)
        stale = [i for i, v in enumerate(versions) if v != version]
        if stale:
            ray.get([self.workers[i].set_weights.remote(weights, version) for i in stale], timeout=timeout_s)
            self._logs.extend(
                (
                    logging.WARNING,
                    f"rollout worker {i} was restarted (weights at version {versions[i]}): weights {version} sent again",
                )
                for i in stale
            )

    def close(self) -> None:
        """Stop the rollout workers (Ray does not restart them); colocated ones are the training ranks, stopped with them."""
        if self.colocated:
            return
        for w in self.workers:
            ray.kill(w, no_restart=True)
