"""The daemon's channel to its worker: one end of a socketpair made at spawn
(contract §10: the daemon's commands travel where no planner can write).

Bytes from the daemon: b"S" = drain and stop. End of file = the daemon is
gone (PR_SET_PDEATHSIG normally kills the worker first): stop too. A worker
started by hand (no channel) stops on SIGTERM instead.
"""

from __future__ import annotations

import os
import signal
import sys

STOP = b"S"
ASKED = "the daemon asked"


class Control:
    def __init__(self, fd: int | None = None):
        self.fd = fd
        self._stop = False
        self.why = ""
        if fd is not None:
            os.set_blocking(fd, False)

    def stop_on_sigterm(self) -> None:
        """No daemon channel: SIGTERM asks for the stop (between ticks)."""
        def handler(signum, frame):
            self._stop = True
            self.why = "SIGTERM"
        signal.signal(signal.SIGTERM, handler)

    def stop_requested(self) -> bool:
        """True once the daemon asked for a stop (or is gone). One
        non-blocking read: cheap enough for every loop of the worker."""
        if self._stop or self.fd is None:
            return self._stop
        try:
            data = os.read(self.fd, 64)
        except BlockingIOError:
            return False
        except OSError as e:
            data = b""
            print(f"superfluid worker: the daemon's channel failed ({e.strerror}); stopping", file=sys.stderr)
        if not data:
            self._stop, self.why = True, "the daemon's channel closed"
        elif STOP in data:
            self._stop, self.why = True, ASKED
        return self._stop
