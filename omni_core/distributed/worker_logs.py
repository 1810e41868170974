"""The `omni_core` loggers of the run's actors (training ranks, rollout workers), brought to the controller.

An actor logs through Python's `logging` (`omni_core.workers.training_actor`, `omni_core.algorithms.update`,
`omni_core.rewards.manager`, ...). Without this module those records end on the actor's stderr, which Ray
copies to the driver's terminal, and never reach the run's log. `ActorLogs.install` puts a bounded buffer on
the actor process's `omni_core` logger (through Ray's `__ray_call__`, so the actor classes stay as they are);
`ActorLogs.collect` drains the buffers, and the controller sends the lines on with its own (`log_callback`),
after every step and validation. A drain never blocks on a busy actor: it waits `wait_s` at most and collects
a late answer at the next call.

`CallbackHandler` does the same for the controller's own process: its `omni_core` records go to a callback
(the Prefect layer's run logger) as they happen. No Prefect here.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import ray

from omni_core.records import LogLine

ROOT_LOGGER = "omni_core"
# Lines an actor keeps between two drains; older ones are dropped (and counted), so a flood never grows memory.
BUFFER_LINES = 1000


class _Buffer(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.lines: collections.deque[LogLine] = collections.deque(maxlen=BUFFER_LINES)
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.lines) == self.lines.maxlen:
            self.dropped += 1
        self.lines.append((record.levelno, f"{record.name}: {record.getMessage()}"))


def _actor_label() -> str:
    name = ray.get_runtime_context().get_actor_name() if ray.is_initialized() else None
    return name or "actor"


def install_log_buffer(_actor: Any = None) -> bool:
    """In an actor process (via `__ray_call__`): buffer its `omni_core` records at INFO and above, instead of
    printing them (the controller forwards them). Idempotent; returns True when it installed the buffer."""
    root = logging.getLogger(ROOT_LOGGER)
    if any(isinstance(h, _Buffer) for h in root.handlers):
        return False
    root.addHandler(_Buffer())
    if root.level == logging.NOTSET or root.level > logging.INFO:
        root.setLevel(logging.INFO)
    root.propagate = False  # the run's log shows them (once); stderr would print them a second time
    return True


def drain_log_buffer(_actor: Any = None) -> list[LogLine]:
    """In an actor process: the buffered lines (prefixed with the actor's name), emptied."""
    buffers = [h for h in logging.getLogger(ROOT_LOGGER).handlers if isinstance(h, _Buffer)]
    if not buffers:
        return []
    buffer, label = buffers[0], _actor_label()
    with buffer.lock:  # emit() runs under the same lock, from any thread (reward threads log too)
        taken, dropped = list(buffer.lines), buffer.dropped
        buffer.lines.clear()
        buffer.dropped = 0
    lines = [(level, f"[{label}] {message}") for level, message in taken]
    if dropped:
        lines.append((logging.WARNING, f"[{label}] {dropped} older log lines dropped (over {BUFFER_LINES} between two drains)"))
    return lines


class ActorLogs:
    """Drains of the actors' buffers still in flight, so a busy actor answers at a later `collect`."""

    def __init__(self) -> None:
        self._pending: dict[Any, ray.ObjectRef] = {}  # actor id -> its drain call

    @staticmethod
    def _unique(actors: Iterable[Any]) -> dict[Any, Any]:
        return {a._actor_id: a for a in actors}  # the hybrid engine's rollout workers are the training ranks

    def install(self, actors: Iterable[Any]) -> None:
        """Buffer the `omni_core` records of `actors` from now on (fire and forget; idempotent per process)."""
        for actor in self._unique(actors).values():
            actor.__ray_call__.remote(install_log_buffer)

    def collect(self, actors: Iterable[Any], wait_s: float) -> list[LogLine]:
        """The lines the actors logged since the last drain, waiting at most `wait_s` for their answers. A drain
        that fails (the actor died: the step surfaces that itself) is dropped."""
        for key, actor in self._unique(actors).items():
            if key not in self._pending:
                self._pending[key] = actor.__ray_call__.remote(drain_log_buffer)
        refs = list(self._pending.values())
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s, fetch_local=True) if refs else ([], [])
        lines: list[LogLine] = []
        for key, ref in list(self._pending.items()):
            if ref in done:
                del self._pending[key]
                try:
                    lines.extend(ray.get(ref))
                except Exception:  # noqa: BLE001  (a dead actor: the training step reports it, with its traceback)
                    continue
        return lines


class CallbackHandler(logging.Handler):
    """Sends every record of a logger to `callback(level, "logger: message")` as it is logged."""

    def __init__(self, callback: Callable[[int, str], None], level: int = logging.INFO):
        super().__init__(level=level)
        self.callback = callback

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.callback(record.levelno, f"{record.name}: {record.getMessage()}")
        except Exception:  # noqa: BLE001  (logging never raises into the code that logs)
            self.handleError(record)


@contextlib.contextmanager
def omni_core_logs_to(log: Callable[[int, str], None]) -> Iterator[None]:
    """Within: records of `omni_core.*` loggers in this process (INFO and up: checkpoint retention, replay
    buffer, TransferQueue) go to `log` as they happen, and only there (not a second time on stderr)."""
    root = logging.getLogger(ROOT_LOGGER)
    handler, level, propagate = CallbackHandler(log), root.level, root.propagate
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        root.propagate = propagate
