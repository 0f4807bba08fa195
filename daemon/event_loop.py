"""What wakes the daemon's one thread: a selector over the workers' pidfds
and a self-pipe. `signal.set_wakeup_fd` writes the number of a SIGTERM,
SIGINT or SIGHUP into the pipe, and `wake(0)` writes a 0 from any thread;
the loop reads them as bytes, in order."""

from __future__ import annotations

import os
import selectors
import signal
import threading
from collections.abc import Callable
from typing import Any

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class EventLoop:
    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()
        self._r = self._w = -1
        try:
            self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            self._sel.register(self._r, selectors.EVENT_READ, None)
        except BaseException:
            self.close()  # nothing made here outlives a failed start
            raise

    def watch(self, fd: int, data: Any) -> None:
        """Report `data` from select() when fd is readable (a pidfd: its process exited)."""
        self._sel.register(fd, selectors.EVENT_READ, data)

    def unwatch(self, fd: int) -> None:
        self._sel.unregister(fd)

    def wake(self, byte: int) -> None:
        """From any thread, or after close (then it does nothing)."""
        try:
            os.write(self._w, bytes([byte]))
        except BlockingIOError:
            pass  # the pipe is full: the loop is waking anyway
        except OSError:
            pass  # already closed

    def select(self, timeout: float | None) -> list[Any]:
        """The data of every watched fd that is readable, None for the pipe
        (then read() has bytes), waiting at most timeout seconds (None: until
        something happens)."""
        return [key.data for key, _ in self._sel.select(timeout)]

    def read(self) -> bytes:
        """The wake-up bytes written so far, without waiting."""
        out = b""
        while True:
            try:
                data = os.read(self._r, 512)
            except BlockingIOError:
                return out
            if not data:
                return out
            out += data

    def install_signals(self) -> Callable[[], None]:
        """Route SIGTERM/SIGINT/SIGHUP into the pipe (on the main thread only);
        returns what puts the old handlers back."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        # The C-level handler writes the signal number into the pipe; the
        # Python handler has nothing left to do but replace the default action.
        old_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        old = {s: signal.signal(s, lambda *_: None) for s in HANDLED}

        def restore() -> None:
            for s, h in old.items():
                signal.signal(s, h)
            signal.set_wakeup_fd(old_fd)

        return restore

    def close(self) -> None:
        self._sel.close()
        for fd in (self._r, self._w):
            if fd >= 0:
                os.close(fd)
        self._r = self._w = -1
