"""The lane ops (contract §7): LIST_LANES shows the lanes the executor holds
(a planner that restarted, or an earlier session's, may not know them), and
RETIRE_LANES ends them between ticks by the very code a plan's retires run
(tick.RetirePhase), so an op retire and a plan retire leave the same state.

LIST_LANES: `after` u64 (default 0: lanes with tag > after), `limit` 1..1024
(default 256). value = lanes held (live + faulted not yet retired); payload
{lanes: [{tag, prompt, generated, state, session}], more} sorted by tag, so
a planner pages with after = the last tag.

RETIRE_LANES: `tags` [u64] (each a live or faulted lane, no duplicates) or
`all: true` (with `session` u64: only the lanes admitted in that session);
`publish` bool (default false: keep each live lane's sequence as a cache
entry, as LaneRetire.publish_to_cache does). All or nothing. value = lanes
retired; payload {retired: [tags]} up to 1024 tags, else {}.
"""

from __future__ import annotations

import msgpack

from superfluid.abi import OpStatus
from superfluid.executor.executor import Executor, ExecutorFatal
from superfluid.executor.lanes import Lane
from superfluid.executor.op_fields import OpError, OpMessage, field, flag, u64, u64_list
from superfluid.executor.tick import RetirePhase

MAX_LIST = 1024
DEFAULT_LIST = 256
MAX_LISTED_RETIRES = 1024  # more retired tags than this: the count only, never a big completion


def _held(ex: Executor) -> list[tuple[int, Lane | None, str]]:
    """Every lane a retire may name, by tag: (tag, lane, state). A faulted
    lane is as it was when it faulted (its sequence is gone)."""
    rows: list[tuple[int, Lane | None, str]] = [(t, ln, ln.phase) for t, ln in ex.lanes.items()]
    rows += [(t, ex.lanes.faulted.lanes.get(t), "faulted") for t in ex.lanes.faulted]
    rows.sort(key=lambda r: r[0])
    return rows


def _row(tag: int, lane: Lane | None, state: str) -> dict[str, object]:
    if lane is None:  # (a tag marked faulted without its lane: nothing more is known)
        return {"tag": tag, "prompt": 0, "generated": 0, "state": state, "session": 0}
    return {"tag": tag, "prompt": len(lane.prompt), "generated": lane.generated, "state": state,
            "session": lane.session}


def list_lanes(ex: Executor, msg: OpMessage) -> tuple[int, int, bytes]:
    after = u64(msg, "after", 0)
    limit = field(msg, "limit", int) if "limit" in msg else DEFAULT_LIST
    if not 1 <= limit <= MAX_LIST:
        raise OpError(OpStatus.BadRequest, f"field 'limit': outside 1..{MAX_LIST}")
    rows = [r for r in _held(ex) if r[0] > after]
    n = min(limit, len(rows))
    while True:
        payload = msgpack.packb({"lanes": [_row(*r) for r in rows[:n]], "more": n < len(rows)})
        # Within half the event slot, as EXPORT_ENTRY: a shorter page, and `more` says so.
        if ex.event_capacity is None or len(payload) <= ex.event_capacity // 2 or n <= 1:
            break
        n //= 2
    return 0, len(ex.lanes) + len(ex.lanes.faulted), payload


def _chosen(ex: Executor, msg: OpMessage) -> list[int]:
    """The tags to retire, in order; every one live or faulted."""
    every = flag(msg, "all")
    if every:
        if "tags" in msg:
            raise OpError(OpStatus.BadRequest, "field 'tags': give 'tags' or 'all': true, not both")
        session = u64(msg, "session") if "session" in msg else None
        return [t for t, ln, _ in _held(ex) if session is None or (ln is not None and ln.session == session)]
    if "session" in msg:
        raise OpError(OpStatus.BadRequest, "field 'session': only with 'all': true")
    if "tags" not in msg:
        raise OpError(OpStatus.BadRequest, "field 'tags' is missing (or give 'all': true)")
    tags = u64_list(msg, "tags")
    for t in tags:
        if t not in ex.lanes and t not in ex.lanes.faulted:
            raise OpError(OpStatus.NoMatch, f"field 'tags': no live or faulted lane {t}")
    return tags


def retire_lanes(ex: Executor, msg: OpMessage) -> tuple[int, int, bytes]:
    if ex.dead:  # the runtime's state is unknown: touch none of it
        raise OpError(OpStatus.Refused, ex.dead)
    publish = flag(msg, "publish")
    tags = _chosen(ex, msg)
    # Between ticks: evictions it causes are reported by the next tick, whose
    # tick number its publishes carry (a plan retire there would do the same).
    phase = RetirePhase(ex, ex.pending.shed, ex.counters.tick_count + 1)
    try:
        phase.retire([(t, publish) for t in tags])
        phase.settle_cache()
    except ExecutorFatal as e:
        raise OpError(OpStatus.Refused, str(e)) from e
    body = {"retired": tags} if len(tags) <= MAX_LISTED_RETIRES else {}
    return 0, len(tags), msgpack.packb(body)
