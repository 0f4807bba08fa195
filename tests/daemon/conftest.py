"""Helpers shared by the daemon tests."""

from __future__ import annotations

import os


def live_workers(name: str) -> list[int]:
    """Pids of live (not zombie) processes whose command line names a segment of `name`."""
    marker = f"superfluid.{name}.".encode()
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{d}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and b"superfluid.daemon.worker" in cmd and state != b"Z":
            pids.append(int(d))
    return pids
