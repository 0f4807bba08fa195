"""How a worker process ends: what its exit codes mean, how an exit is told,
and the parent-death signal that ends it with the daemon (daemon/supervisor.py
runs the restart policy around them)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable

# Worker exit codes (daemon/worker.py) and what they mean.
EXIT_REASONS = {
    0: "it left though not asked to stop",
    2: "bad arguments, or a segment it cannot open",
    3: "the model would not load",
    4: "the model or its options can never be served: a restart would fail the same way",
    5: "a tensor-parallel rank whose group broke",
    70: "the runtime failed fatally",
}

EXIT_SPAWN_FAILED = 127  # the worker process could not be started at all
KILL_WAIT_S = 5.0  # after SIGKILL, how long to wait for the kernel to reap

_PR_SET_PDEATHSIG = 1


def short_exit(status: int) -> str:
    """'exit 3' or 'killed by signal 9'."""
    return f"killed by signal {-status}" if status < 0 else f"exit {status}"


def describe_exit(status: int) -> str:
    """short_exit plus why: 'exit 3 (the model would not load)', 'killed by signal 9 (SIGKILL)'."""
    if status < 0:
        try:
            why = signal.Signals(-status).name
        except ValueError:
            return short_exit(status)
    else:
        why = EXIT_REASONS.get(status, "")
    return f"{short_exit(status)} ({why})" if why else short_exit(status)


def open_pidfd(proc: subprocess.Popen[bytes]) -> int:
    """A pidfd of the process just started (readable once it exits); on failure
    the process is killed and reaped, and the OSError raised."""
    try:
        return os.pidfd_open(proc.pid)
    except OSError:
        proc.kill()
        proc.wait()
        raise


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    # prctl's arguments are unsigned longs: without argtypes ctypes would pass
    # C ints, leaving the registers' upper halves undefined.
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_int
    return fn


_prctl = _load_prctl()  # resolved in the parent: the child after fork only calls it


def die_with_parent(parent: int) -> Callable[[], None] | None:
    """A preexec_fn that makes the child die when `parent` does."""
    prctl = _prctl
    if prctl is None:
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the daemon died before prctl took effect: nobody will signal us
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec
