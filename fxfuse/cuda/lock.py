"""A cross-process file lock with stale-lock recovery, for the build cache.

The lock is a file created with O_EXCL holding ``pid timestamp host token``. A lock whose process is
gone (same host) or that is older than ``stale_after`` seconds is broken. Creating, breaking and
releasing happen inside a short kernel lock (``flock`` on ``<path>.guard``, released by the kernel
if its holder dies), so two waiters never both break a lock and then delete each other's new one.
Waiting for the lock itself is polling, with a timeout. The lock tells its taker whether it
broke a dead process's lock: what that process started may still run (orphans.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
import uuid
from pathlib import Path


class LockTimeout(TimeoutError):
    """The lock stayed held (and fresh) for longer than the timeout."""


class FileLock:
    def __init__(
        self,
        path: str | os.PathLike,
        timeout: float = 900.0,
        stale_after: float = 1800.0,
        poll: float = 0.2,
    ) -> None:
        self.path = Path(path)
        self.guard = self.path.with_name(self.path.name + ".guard")
        self.timeout = timeout
        self.stale_after = stale_after
        self.poll = poll
        self.token = ""
        self.took_from_the_dead = False  # acquire() broke the lock of a process of this host that died

    def __enter__(self) -> "FileLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        deadline = time.monotonic() + self.timeout
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            with self._guarded():
                holder = _read(self.path)
                if holder is None or self._is_stale(holder):
                    self.took_from_the_dead = holder is not None and _died_here(holder)
                    self._write()
                    return
            if time.monotonic() > deadline:
                raise LockTimeout(f"{self.path} held by {holder!r} for more than {self.timeout:.0f} s")
            time.sleep(self.poll)

    def release(self) -> None:
        if not self.token:
            return
        with self._guarded():
            holder = _read(self.path)
            if holder is not None and holder.get("token") == self.token:
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
        self.token = ""

    # -- internals -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _guarded(self):
        fd = os.open(self.guard, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    def _write(self) -> None:
        self.token = uuid.uuid4().hex
        tmp = self.path.with_name(f"{self.path.name}.{self.token}")
        tmp.write_text(f"{os.getpid()} {time.time()!r} {socket.gethostname()} {self.token}\n")
        os.replace(tmp, self.path)  # atomic: readers never see a half-written lock

    def _is_stale(self, holder: dict) -> bool:
        if holder.get("unreadable"):
            return True
        if time.time() - holder["time"] > self.stale_after:
            return True
        return _died_here(holder)


def _died_here(holder: dict) -> bool:
    """Whether ``holder`` was a process of this host that is gone."""
    return not holder.get("unreadable") and holder["host"] == socket.gethostname() and not _alive(holder["pid"])


def _read(path: Path) -> dict | None:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return {"unreadable": True}
    parts = text.split()
    try:
        return {"pid": int(parts[0]), "time": float(parts[1]), "host": parts[2], "token": parts[3]}
    except (IndexError, ValueError):
        return {"unreadable": True}


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
