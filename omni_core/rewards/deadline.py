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
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
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


def _serve(jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        fn, args, done = job
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the caller, who decides (a reward's error fails its sample)
            done.set_exception(exc)
        else:
            done.set_result(result)
