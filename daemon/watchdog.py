"""The stall watchdog (`serve --tick-timeout S`): a worker whose loop has not
moved for S seconds is killed and restarted like a dead one.

A worker's loop stamps its heartbeat every few milliseconds, idle or busy,
while it waits for its planner to read events, and before each op and plan;
only a tick or an op that does not return (a device, a collective or a
kernel that hangs; a process stopped) holds it still. The stamp is in the
worker's metrics block (daemon/metrics.py), which only the daemon and the
worker map: the segment header's heartbeat is the planner's to read, and
anyone's to scribble on. So a heartbeat older
than the timeout is a stall, and a planner that stops sending plans is not.
The timeout must exceed the longest tick the worker runs (a long prefill of a
big model): 300 s by default.
"""

from __future__ import annotations

DEFAULT_TICK_TIMEOUT_S = 300.0


def check_interval(timeout_s: float) -> float:
    """How often the daemon looks: often enough to act within ~5% of the timeout."""
    return min(1.0, max(0.05, timeout_s / 20))


def stall_age(heartbeat_ns: int, now_ns: int, timeout_s: float) -> float | None:
    """Seconds the heartbeat has not moved, when past the timeout (None: not
    stalled, or no heartbeat yet)."""
    if not heartbeat_ns or timeout_s <= 0:
        return None
    # (a beat from this worker's start on: restarted() clears it before the next worker)
    age = (now_ns - heartbeat_ns) / 1e9
    return age if age > timeout_s else None
