"""Which segments a daemon may take over: none that a live daemon of the same
name holds (in this process or another), and none left past its worker count
by a dead one with more workers."""

from __future__ import annotations

import logging
import os
import stat
import threading

from superfluid.rings.errors import SegmentError
from superfluid.rings.liveness import pid_alive
from superfluid.rings.naming import segment_path
from superfluid.rings.segment import Segment

from .status import segment_paths

log = logging.getLogger("superfluid.daemon")

# Segment paths of the daemons running in this process: a second Daemon of the
# same name here would replace the first one's live segments (the pid check
# below cannot tell them apart).
_IN_PROCESS: set[str] = set()
_IN_PROCESS_LOCK = threading.Lock()


def register_in_process(name: str) -> str:
    """Claim `name` for a daemon of this process; the key to release_in_process."""
    key = segment_path(name, 0)
    with _IN_PROCESS_LOCK:
        if key in _IN_PROCESS:
            raise SegmentError(f"{key}: daemon {name!r} is running in this process; stop it first "
                               "or choose another name")
        _IN_PROCESS.add(key)
    return key


def release_in_process(key: str) -> None:
    with _IN_PROCESS_LOCK:
        _IN_PROCESS.discard(key)


def check_no_live_daemon(name: str) -> None:
    """Raise if another process's daemon named `name` is alive."""
    for _, path in segment_paths(name):
        try:
            with Segment.open_path(path) as seg:
                pid = int(seg.header.daemon_pid)
        except SegmentError:
            continue  # not a readable segment: Segment.create decides whether to replace it
        if pid != os.getpid() and pid_alive(pid):
            raise SegmentError(f"{path}: daemon {name!r} is running (pid {pid}); stop it first "
                               "or choose another --name")


def remove_stale_segments(name: str, n_workers: int) -> None:
    """A dead daemon with more workers left higher-numbered segments:
    status would show ghosts. Only ours: another user's file is named
    in the log and left alone."""
    for index, path in segment_paths(name):
        if index < n_workers:
            continue
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
            log.warning("stale segment %s belongs to uid %d (not a file of ours): left alone", path, st.st_uid)
            continue
        log.info("removing stale segment %s", path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("stale segment %s: cannot remove it: %s", path, e.strerror)
