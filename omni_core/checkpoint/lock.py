"""`RunLock`: one run per checkpoint folder (docs/design.md section 2: a second run pointed at a folder in use
is refused).

The lock is `<root>/.omniflow.lock`, holding JSON {pid, host, run_id, started} for people and error
messages. Ownership itself is an exclusive `flock` on that file: the kernel drops it when the holder dies,
so a lock left by a crashed run (its pid no longer alive) is taken over without a race between two
newcomers, and a reused pid cannot fake a live holder. On filesystems without flock the JSON alone
decides: a live pid on this host, or any pid on another host, holds the lock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from omni_core.checkpoint.layout import LOCK_FILE

log = logging.getLogger(__name__)

_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}


class RunLockError(RuntimeError):
    """The checkpoint folder is in use by another live run."""


def pid_alive(pid: int) -> bool:
    """Whether `pid` is a live process on this host."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


class RunLock:
    """`with RunLock(root, run_id=...):` holds `<root>/.omniflow.lock` for the duration of a run."""

    def __init__(self, root: str | Path, run_id: str | None = None):
        self.root = Path(root)
        self.path = self.root / LOCK_FILE
        self.run_id = run_id or f"pid-{os.getpid()}"
        self.previous_holder: dict[str, Any] | None = None  # a stale holder this lock took over
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> RunLock:
        if self._fd is not None:
            return self
        self.root.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunLockError(self._refusal(read_lock(self.path))) from None
            except OSError as exc:
                if exc.errno not in _NO_FLOCK:
                    os.close(fd)
                    raise
                self._check_holder_by_pid(fd)  # no flock on this filesystem: the JSON decides
            # A releasing holder unlinks the file; if ours is no longer the file at the path, try again.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        previous = _parse(os.pread(fd, 1 << 16, 0))
        if previous and previous.get("pid") is not None:
            self.previous_holder = previous
            log.warning(
                "taking over the stale lock %s of run %r (pid %s on %s, no longer running)",
                self.path,
                previous.get("run_id"),
                previous.get("pid"),
                previous.get("host"),
            )
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "run_id": self.run_id,
            "started": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        # Unlink before unlocking, so nobody can lock the old file once we let go (see acquire's inode check).
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _check_holder_by_pid(self, fd: int) -> None:
        holder = _parse(os.pread(fd, 1 << 16, 0))
        if not holder or (holder.get("pid") == os.getpid() and holder.get("run_id") == self.run_id):
            return
        other_host = holder.get("host") != socket.gethostname()
        if other_host or pid_alive(int(holder.get("pid", -1))):
            os.close(fd)
            raise RunLockError(self._refusal(holder))

    def _refusal(self, holder: dict[str, Any] | None) -> str:
        who = (
            f"run {holder.get('run_id')!r} (pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')})"
            if holder
            else "another live process"
        )
        return (
            f"checkpoint folder {self.root} is in use by {who}. Wait for that run to finish or stop it, or "
            f"give this run its own folder (trainer.experiment_name=... or trainer.default_local_dir=...). "
            f"If that run is certainly dead, delete {self.path}."
        )


def read_lock(path: str | Path) -> dict[str, Any] | None:
    """The JSON of a lock file, or None when absent or unreadable (e.g. caught mid-write)."""
    try:
        return _parse(Path(path).read_bytes())
    except FileNotFoundError:
        return None


def _parse(data: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(data.decode() or "null")
    except (ValueError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None
