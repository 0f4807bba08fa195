"""sf_queue_heads_up: a producer wakes a consumer asleep in a wait before it
publishes, and the consumer spins (SF_HEADS_UP_SPIN_NS) instead of sleeping
again, so the message that follows does not wait for a wake-up from sleep."""

from __future__ import annotations

import threading
import time

import pytest

from superfluid.abi import lib
from superfluid.rings.queue import QueueTimeout
from superfluid.testing.heads_up import woken_by


def test_a_heads_up_wakes_a_sleeping_consumer_which_sleeps_again_if_nothing_comes(segment):
    q = segment.event_queue
    assert woken_by(q, q.heads_up)


def test_without_one_the_consumer_sleeps_on(segment):
    # The negative control: the same watch sees no wake-up where nothing was sent.
    assert not woken_by(segment.event_queue, lambda: None, tries=3)


def test_heads_ups_neither_stretch_nor_cut_a_timeout(segment):
    q = segment.event_queue
    stop = threading.Event()

    def nag() -> None:  # a heads-up every millisecond, and nothing ever published
        while not stop.is_set():
            q.heads_up()
            time.sleep(0.001)

    th = threading.Thread(target=nag, daemon=True)
    th.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(QueueTimeout, match="nothing"):
            q.peek(0.3, spin_ns=0)
    finally:
        stop.set()
        th.join(10)
    assert 0.29 <= time.monotonic() - t0 < 3


def test_the_spin_outlasts_building_events_not_a_tick():
    assert 500_000 <= lib.SF_HEADS_UP_SPIN_NS <= 5_000_000
