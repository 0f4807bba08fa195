"""Whether a process a segment names (its daemon, its worker, a writer) still runs."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """A running process; a zombie is not (it is dead, waiting to be reaped)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                return False
    except (OSError, IndexError):
        pass  # no /proc: kill(0) alone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's: not ours to judge
    return True
