"""Watching a consumer asleep in a queue wait: is it woken by an action
(its consumer_sleeping flag drops with nothing published: it spins)?"""

from __future__ import annotations

import threading
import time

from superfluid.abi import ffi, lib

# How long the consumer must be seen awake to count as spinning (a consumer
# that went straight back to sleep is awake for microseconds).
SPUN_S = 0.0003


def _in_futex(tid: int) -> bool:
    try:
        with open(f"/proc/self/task/{tid}/wchan") as f:
            return "futex" in f.read()
    except OSError:
        return False


def woken_by(q, action, *, tries: int = 20) -> bool:
    """Whether `action()` wakes a thread asleep in one C wait on q (one call,
    no slices: nothing else wakes it). Tried up to `tries` times, each once
    the thread is back asleep in the futex: a loaded machine may hide one
    2 ms spin from this poll, not twenty. A woken consumer must sleep again
    while nothing comes (the spin is bounded), and read the message that
    comes at the end."""
    got: list = []
    tid: list[int] = []

    def consumer() -> None:
        tid.append(threading.get_native_id())
        got.append(int(lib.sf_queue_wait_peek(q._view, ffi.NULL, 0, 0, int(60e9), 0)))

    th = threading.Thread(target=consumer, daemon=True)
    th.start()
    flag = q._view.q
    seen = False
    try:
        for _ in range(tries):
            deadline = time.monotonic() + 10
            while not (tid and flag.consumer_sleeping and _in_futex(tid[0])):
                assert time.monotonic() < deadline, "the consumer never slept in the futex"
                time.sleep(0.001)
            action()
            end = time.monotonic() + 0.05
            while time.monotonic() < end and flag.consumer_sleeping:
                pass
            # Awake for a while, not just between two sleeps: spinning.
            t0 = time.monotonic()
            while not flag.consumer_sleeping and time.monotonic() - t0 < SPUN_S:
                pass
            if time.monotonic() - t0 >= SPUN_S:
                assert len(q) == 0 and not got  # woken with nothing there, and still waiting
                seen = True
                break
        deadline = time.monotonic() + 5
        while not flag.consumer_sleeping:
            assert time.monotonic() < deadline, "still spinning long after SF_HEADS_UP_SPIN_NS"
            time.sleep(0.001)
        assert not got
    finally:
        slot = q.try_reserve()
        slot[16:24] = b"wake-up!"
        q.publish()
        th.join(10)
    assert len(got) == 1 and got[0] >= 0
    assert bytes(q.try_peek()[16:24]) == b"wake-up!"
    q.release()
    return seen
