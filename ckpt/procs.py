"""Whether a process of this host that left a file behind may still be writing it.

Temporary names carry their writer's pid (a staging directory, a half-made memory-tier segment, a
``SAVING`` record). A pid alone does not name a process for long: containers restart their processes
under the same small pids, and a pid is reused once its process is gone. So a process counts as the
writer of a file only if it lives *and* started before the file was last modified.
"""

from __future__ import annotations

import os

__all__ = ["alive", "started"]

#: seconds of slack between a process's start time (clock ticks since boot) and a file's mtime
_SLACK_S = 2.0


def started(pid: int) -> float | None:
    """Wall-clock start time of process ``pid`` in seconds since the epoch (Linux ``/proc``), or
    ``None`` where it cannot be had (no such process, no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open("/proc/stat", "rb") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        return btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def alive(pid: int, since: float | None = None) -> bool:
    """Whether process ``pid`` of this host lives and may be the one that wrote a file at wall-clock
    time ``since`` (``None``: any live process with that pid counts). A process that started after
    ``since`` got the pid again and is never that file's writer. This process counts only for files
    it may have written itself: one modified before it started was an earlier process's with its pid.
    Another user's process with that pid counts as alive (it cannot be told apart)."""
    if pid != os.getpid():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # another user's process
    if since is not None:
        start = started(pid)
        if start is not None and start > since + _SLACK_S:
            return False
    return True
