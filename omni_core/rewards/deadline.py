"""Reward calls with a deadline (`reward.timeout_s`), run in a background thread of the calling process.

Why a thread, not a process: a reward function usually holds a model (an OCR net, CLIP, a VLM judge)
that its module loads once inside the rollout worker. A subprocess per call would reload it every call;
a process pool would keep a copy per child, need the function to pickle, and ship every image across
processes. A thread shares the loaded model and the device, and costs microseconds per call.

The price: Python cannot kill a thread. A call that misses its deadline is abandoned, not stopped: it
runs on in its daemon thread until it returns (its result is then dropped) or the worker process exits.
Meanwhile it keeps whatever memory it holds, and a busy loop keeps a core busy and competes for the GIL
(a call blocked on I/O or a sleep costs nothing). The next call gets a fresh thread, so the worker stays
usable. Daemon threads, not a `ThreadPoolExecutor`: an executor joins its threads at interpreter exit,
so one hung call would keep the process from ever exiting.

Batched terms (model rewards, reward servers) go through `call_batches`: each batch call gets a daemon thread of
its own, at most `concurrency` run at once, and each has its own deadline counted from its start. Once one
batch timed out, the batches not started yet fail without a call (as a hung per-sample term's later samples do).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

__all__ = ["DeadlineRunner", "RewardTimeout"]


class RewardTimeout(TimeoutError):
    """A reward call did not return within `reward.timeout_s`."""


class DeadlineRunner:
    """Calls functions one at a time in a worker thread and gives up on each after `timeout_s` seconds.

    `timeout_s=None` calls in the caller's thread, with no deadline and no thread.
    """

    def __init__(self, timeout_s: float | None) -> None:
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"reward.timeout_s={timeout_s} must be > 0 (or null for no deadline)")
        self.timeout_s = timeout_s
        self._jobs: queue.SimpleQueue | None = None
        self.abandoned = 0  # calls left running in a thread after their deadline

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`, or `RewardTimeout` once `timeout_s` passed (the call runs on, abandoned)."""
        if self.timeout_s is None:
            return fn(*args)
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._jobs,), name="omniflow-reward-call", daemon=True).start()
        done: Future = Future()
        self._jobs.put((fn, args, done))
        if not wait([done], timeout=self.timeout_s).done:
            # Its thread is busy for good: tell it to exit once the call returns, and use a new one from now on.
            self._jobs.put(None)
            self._jobs = None
            self.abandoned += 1
            raise RewardTimeout(f"timed out after {self.timeout_s:g} s (reward.timeout_s)")
        return done.result()

    def call_batches(self, fn: Callable[[Any], Any], jobs: Sequence[Any], concurrency: int = 1) -> list[Any]:
        """`fn(job)` for each job, at most `concurrency` at once, each within `timeout_s` of its own start.

        Returns one entry per job: its result, or the exception it raised, or a `RewardTimeout` (it missed its
        deadline and runs on abandoned, or it was not called because an earlier batch of this call timed out).
        """
        if self.timeout_s is None and concurrency == 1:  # no deadline, nothing to overlap: the caller's thread
            return [_outcome(fn, job) for job in jobs]
        results: list[Any] = [None] * len(jobs)
        pending = deque(range(len(jobs)))
        running: dict[Future, tuple[int, float]] = {}  # future -> (job index, start time)
        hung_at: int | None = None
        while pending or running:
            while pending and hung_at is None and len(running) < concurrency:
                k = pending.popleft()
                done: Future = Future()
                thread = threading.Thread(target=_run_one, args=(fn, jobs[k], done), name="omniflow-reward-batch", daemon=True)
                running[done] = (k, time.monotonic())
                thread.start()
            if not running:
                break
            timeout = None
            if self.timeout_s is not None:
                timeout = max(0.0, min(start for _, start in running.values()) + self.timeout_s - time.monotonic())
            finished, _ = wait(list(running), timeout=timeout, return_when=FIRST_COMPLETED)
            for future in finished:
                k, _ = running.pop(future)
                results[k] = future.exception() or future.result()
            now = time.monotonic()
            for future, (k, start) in list(running.items()):
                if self.timeout_s is not None and now - start >= self.timeout_s:
                    running.pop(future)
                    self.abandoned += 1
                    results[k] = RewardTimeout(f"timed out after {self.timeout_s:g} s (reward.timeout_s)")
                    hung_at = k if hung_at is None else min(hung_at, k)
        for k in pending:
            results[k] = RewardTimeout(
                f"not called: batch {hung_at} of this call timed out after {self.timeout_s:g} s (reward.timeout_s)"
            )
        return results


def _outcome(fn: Callable[[Any], Any], job: Any) -> Any:
    try:
        return fn(job)
    except Exception as exc:  # handed back as the job's outcome (a batch's error fails its samples)
        return exc


def _run_one(fn: Callable[[Any], Any], job: Any, done: Future) -> None:
    try:
        done.set_result(fn(job))
    except BaseException as exc:
        done.set_exception(exc)


def _serve(jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        fn, args, done = job
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the caller, who decides (a reward's error fails its sample)
            done.set_exception(exc)
        else:
            done.set_result(result)
