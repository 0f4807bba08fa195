"""The request/response layer `superfluid bench ring` measures: one message
format (an empty TickPlan in, TickEvents out, plan_seq read and patched in
place), three transports carrying it (shared-memory queues, a unix socket, a
pair of pipes), the server process that answers on each, and the control
messages that switch its mode."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
from collections.abc import Callable
from typing import Protocol

from superfluid.abi import Status, TickStatus, codec, ffi
from superfluid.abi.plan_codec import decode_plan, encode_events_into
from superfluid.abi.records import TickEvents
from superfluid.client import PlanBuilder
from superfluid.rings.queue import QueueTimeout, SlotQueue
from superfluid.rings.segment import Segment

_U64 = struct.Struct("<Q")
_LEN = struct.Struct("<I")
# plan_seq sits at the same place in both messages, so control messages and
# raw mode can read and patch it without the codec.
_SEQ_AT = codec.MSG_HEADER_BYTES + ffi.offsetof("TickPlan", "plan_seq")
assert codec.MSG_HEADER_BYTES + ffi.offsetof("TickEvents", "plan_seq") == _SEQ_AT

# Control messages: empty plans with a plan_seq at the top of the u64 range.
_CMD_EXIT = 2**64 - 1
_CMD_CODEC = 2**64 - 2  # mode: decode the plan, encode events (the default)
_CMD_RAW = 2**64 - 3  # mode: answer with pre-encoded events, no codec
_CMD_FLOOD = 2**64 - 4  # mode: consume plans, answer nothing
_CMD_FLOOD_END = 2**64 - 5  # answer once, plan_seq = plans consumed
_CMD_MIN = _CMD_FLOOD_END

_OK = int(Status.OK)
_TICK_OK = int(TickStatus.OK)
_PLAN_BLOB = PlanBuilder(0).encode()
_EVENTS_BLOB = codec.encode("TickEvents", TickEvents(status=_OK, tick_status=_TICK_OK))

# Longest wait between liveness checks of the other process.
_POLL_S = 1.0
_STREAM_BUF = 1 << 16


class BenchError(RuntimeError):
    """The benchmark could not run: a server died or answered wrongly."""


class PeerClosed(BenchError):
    """The other end of a stream closed it."""


# ------------------------------------------------------------- transports


class _End(Protocol):
    """One side of a request/response channel. recv() returns the next
    message, valid until done(); out() a buffer to encode into, sent by
    send(n) with n the bytes written."""

    def recv(self) -> memoryview: ...

    def done(self) -> None: ...

    def out(self) -> memoryview: ...

    def send(self, n: int) -> None: ...


class _ShmEnd:
    """Messages are queue slots: encoded and decoded in place."""

    def __init__(self, rx: SlotQueue, tx: SlotQueue, alive: Callable[[], None], spin_ns: int):
        self._rx = rx
        self._tx = tx
        self._alive = alive
        self._spin_ns = spin_ns

    def recv(self) -> memoryview:
        while True:
            try:
                return self._rx.peek(_POLL_S, spin_ns=self._spin_ns)
            except QueueTimeout:
                self._alive()

    def done(self) -> None:
        self._rx.release()

    def out(self) -> memoryview:
        while True:
            try:
                return self._tx.reserve(_POLL_S, spin_ns=self._spin_ns)
            except QueueTimeout:
                self._alive()

    def send(self, n: int) -> None:
        self._tx.publish()

    def has_room(self) -> bool:
        return self._tx.try_reserve() is not None


class _StreamEnd:
    """Length-prefixed messages (u32 LE) over a byte stream; one message is
    in flight at a time, so a read never runs into the next one."""

    def __init__(self, name: str, readinto: Callable[[memoryview], int], write: Callable[[memoryview], None]):
        self.name = name
        self._readinto = readinto
        self._write = write
        self._in = memoryview(bytearray(_STREAM_BUF))
        self._out = memoryview(bytearray(_STREAM_BUF))
        self._body = self._out[_LEN.size:]

    def _fill(self, got: int, need: int) -> int:
        while got < need:
            try:
                k = self._readinto(self._in[got:])
            except ConnectionResetError:
                k = 0
            if not k:
                raise PeerClosed(f"{self.name}: the other side closed the stream")
            got += k
        return got

    def recv(self) -> memoryview:
        got = self._fill(0, _LEN.size)
        need = _LEN.size + _LEN.unpack_from(self._in)[0]
        if need > len(self._in):
            raise BenchError(f"stream message of {need} bytes exceeds the {len(self._in)}-byte buffer")
        if self._fill(got, need) != need:
            raise BenchError("stream carried more than one message")
        return self._in[_LEN.size:need]

    def done(self) -> None:
        pass

    def out(self) -> memoryview:
        return self._body

    def send(self, n: int) -> None:
        _LEN.pack_into(self._out, 0, n)
        try:
            self._write(self._out[:_LEN.size + n])
        except (BrokenPipeError, ConnectionResetError):
            raise PeerClosed(f"{self.name}: the other side closed the stream") from None


def _socket_end(sock: socket.socket) -> _StreamEnd:
    return _StreamEnd("unix_socket", sock.recv_into, sock.sendall)


def _pipe_end(rfd: int, wfd: int) -> _StreamEnd:
    def readinto(mv: memoryview) -> int:
        return os.readv(rfd, [mv])

    def write(mv: memoryview) -> None:
        while mv:
            mv = mv[os.write(wfd, mv):]

    return _StreamEnd("pipe", readinto, write)


# ------------------------------------------------------------------ server


def _reply_raw(end: _End, seq: int) -> None:
    out = end.out()
    n = len(_EVENTS_BLOB)
    out[:n] = _EVENTS_BLOB
    _U64.pack_into(out, _SEQ_AT, seq)
    end.send(n)


def _events(plan_seq: int) -> TickEvents:
    return TickEvents(plan_seq=plan_seq, status=_OK, tick_status=_TICK_OK)


def _serve(end: _End) -> None:
    mode = _CMD_CODEC
    consumed = 0
    while True:
        buf = end.recv()
        seq = _U64.unpack_from(buf, _SEQ_AT)[0]
        if seq >= _CMD_MIN:
            end.done()
            if seq == _CMD_EXIT:
                return
            if seq == _CMD_FLOOD_END:
                _reply_raw(end, consumed)
                consumed = 0
                mode = _CMD_CODEC
            else:
                _reply_raw(end, seq)
                mode = seq
        elif mode == _CMD_CODEC:
            plan = decode_plan(buf)
            end.done()
            end.send(encode_events_into(end.out(), _events(plan.plan_seq)))
        elif mode == _CMD_RAW:
            end.done()
            _reply_raw(end, seq)
        else:
            end.done()
            consumed += 1


def _orphan_check() -> Callable[[], None]:
    """Exit once the benchmark process is gone (a child must not outlive it)."""
    parent = os.getppid()

    def check() -> None:
        if os.getppid() != parent:
            raise SystemExit(0)

    return check


def _shm_server(path: str, spin_ns: int) -> None:
    seg = Segment.open_path(path)
    try:
        _serve(_ShmEnd(seg.plan_queue, seg.event_queue, _orphan_check(), spin_ns))
    finally:
        seg.close()


def _socket_server(fd: int) -> None:
    with socket.socket(fileno=fd) as sock:
        try:
            _serve(_socket_end(sock))
        except PeerClosed:
            pass


def _pipe_server(rfd: int, wfd: int) -> None:
    try:
        _serve(_pipe_end(rfd, wfd))
    except PeerClosed:
        pass
    finally:
        os.close(rfd)
        os.close(wfd)


def _server_main(argv: list[str]) -> None:
    """A server process: `shm PATH SPIN_NS`, `unix_socket FD` or `pipe RFD WFD`."""
    kind, *args = argv
    if kind == "shm":
        _shm_server(args[0], int(args[1]))
    elif kind == "unix_socket":
        _socket_server(int(args[0]))
    elif kind == "pipe":
        _pipe_server(int(args[0]), int(args[1]))
    else:
        raise SystemExit(f"unknown transport {kind!r}")


# Pins itself before anything else so that threads started by imports
# (numpy's) inherit the mask.
_CHILD = """import os, sys
if sys.argv[1] != "-":
    os.sched_setaffinity(0, {int(sys.argv[1])})
from superfluid.bench.ring_rpc import _server_main
_server_main(sys.argv[2:])
"""


def _spawn(kind: str, *args: str | int, cpu: int | None,
           pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
    """A fresh interpreter, not multiprocessing: nothing of the caller's
    state (threads, its __main__) is copied or re-imported."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    argv = [sys.executable, "-P", "-c", _CHILD, "-" if cpu is None else str(cpu), kind, *map(str, args)]
    return subprocess.Popen(argv, pass_fds=pass_fds, stdin=subprocess.DEVNULL, env=env)


def _command(end: _End, cmd: int) -> int:
    """Send a control message; the server's answer (the plan_seq it sends
    back), none for EXIT. Answering every command keeps the streams to one
    message in flight."""
    out = end.out()
    n = len(_PLAN_BLOB)
    out[:n] = _PLAN_BLOB
    _U64.pack_into(out, _SEQ_AT, cmd)
    end.send(n)
    if cmd == _CMD_EXIT:
        return 0
    got = _U64.unpack_from(end.recv(), _SEQ_AT)[0]
    end.done()
    return got
