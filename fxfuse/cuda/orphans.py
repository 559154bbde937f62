"""The compiles a killed build left running, found by their working directory and stopped.

cpp_extension runs ninja in the build's directory, and ninja's compilers inherit it. A builder
killed outright (SIGKILL: a time limit, the out-of-memory killer, a notebook kernel restarted) takes
none of them with it: they run on in ``<key>.partial``. The next build of that key, resuming there,
would link objects they are still writing, and once the entry is renamed into place they would
write on into it. That build stops them first. Linux only (``/proc``); elsewhere nothing is found.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def processes_working_in(directory: Path) -> list[int]:
    """Live processes (not zombies) of this user whose working directory is ``directory`` or under it."""
    target = os.path.realpath(directory)
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    found = []
    for name in names:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            cwd = os.readlink(f"/proc/{name}/cwd")
            with open(f"/proc/{name}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):  # gone, or another user's
            continue
        if state != "Z" and (cwd == target or cwd.startswith(target + os.sep)):
            found.append(int(name))
    return found


def stop_processes_in(directory: Path, wait: float = 10.0) -> int:
    """Kill every process working in ``directory`` and wait (up to ``wait`` s) until none is left;
    how many there were."""
    pids = processes_working_in(directory)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + wait
    while processes_working_in(directory) and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(pids)
