"""`superfluid status [NAME] [--json]`: what a daemon's workers are doing.

Reads every segment /dev/shm/superfluid.NAME.<i> ($SUPERFLUID_SHM_DIR if
set) and prints, per worker: state, pid, epoch, restarts, how the last
worker ended, and the counters the worker keeps current (ticks, rejects,
live lanes, prefix cache, tokens emitted, last fault, heartbeat age).

Exit status: 0 when the daemon is running; 1 when no segment of that name
exists, or when the segments are left over from a daemon that is gone.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Any

from superfluid.abi import Fault, WorkerState, lib
from superfluid.rings.errors import SegmentError
from superfluid.rings.liveness import pid_alive
from superfluid.rings.naming import NAME_RE, parse_segment_path, shm_dir
from superfluid.rings.segment import Segment, state_name

DEFAULT_NAME = "superfluid"


def segment_paths(name: str) -> list[tuple[int, str]]:
    """(index, path) of every segment of daemon `name`, by index."""
    if not NAME_RE.match(name):
        raise SegmentError(f"name {name!r}: 1-31 characters of [A-Za-z0-9_.-], starting with a letter or digit")
    prefix = os.path.join(shm_dir(), f"superfluid.{name}.")
    found = []
    for path in glob.glob(glob.escape(prefix) + "*"):
        # Only names segment_path makes: anyone may put "superfluid.NAME.²" there.
        if (parsed := parse_segment_path(path)) is not None and parsed[0] == name:
            found.append((parsed[1], path))
    return sorted(found)


def worker_snapshot(seg: Segment) -> dict[str, Any]:
    """One worker's header and counters as plain data (status, metrics)."""
    h = seg.header
    c = h.counters
    now = lib.sf_monotonic_ns()
    state = seg.worker_state
    fault_code = int(c.last_fault_code)
    try:
        fault_name = Fault(fault_code).name if fault_code else None
    except ValueError:
        fault_name = str(fault_code)
    return {
        "index": seg.index,
        "state": state_name(state),
        "state_code": int(state),
        "ready": int(state == WorkerState.READY),
        "pid": int(h.worker_pid),
        "daemon_pid": int(h.daemon_pid),
        "epoch": seg.epoch,
        "restarts": int(h.restarts),
        "last_exit_status": int(h.last_exit_status),
        "ticks": int(c.ticks),
        "rejects": int(c.rejects),
        "last_plan_seq": int(c.last_plan_seq),
        "live_lanes": int(c.live_lanes),
        "cache_entries": int(c.cache_entries),
        "cache_bytes": int(c.cache_bytes),
        "tokens_emitted": int(c.tokens_emitted),
        "last_fault": {"lane": int(c.last_fault_lane), "code": fault_code, "name": fault_name} if fault_code else None,
        # CLOCK_MONOTONIC is system-wide, so the worker's stamp compares with ours.
        "heartbeat_age_s": round(max(0, now - c.heartbeat_ns) / 1e9, 3) if c.heartbeat_ns else None,
        # The worker waits for its planner to read events: since how long (None: it does not).
        "blocked_on_planner_s": round(max(0, now - c.blocked_since_ns) / 1e9, 3) if c.blocked_since_ns else None,
        "session": int(c.session_id),
        "stale_messages": int(c.stale_messages),
        "queue_resets": int(c.queue_resets),
        "state_age_s": round(max(0, now - h.state_changed_ns) / 1e9, 3) if h.state_changed_ns else None,
        "path": seg.path,
    }


def read_status(name: str) -> dict[str, Any] | None:
    """The daemon's state as plain data, or None when it has no segment."""
    paths = segment_paths(name)
    if not paths:
        return None
    workers: list[dict[str, Any]] = []
    daemon_pid = 0
    for index, path in paths:
        try:
            seg = Segment.open_path(path)
        except SegmentError as e:  # half made, or being removed: say so, show the rest
            workers.append({"index": index, "path": path, "error": str(e)})
            continue
        with seg:
            snap = worker_snapshot(seg)
        daemon_pid = daemon_pid or snap["daemon_pid"]
        workers.append(snap)
    return {"name": name, "shm_dir": shm_dir(), "daemon_pid": daemon_pid,
            "daemon_running": pid_alive(daemon_pid), "workers": workers}


# ------------------------------------------------------------------ output


def _exit_text(w: dict[str, Any]) -> str:
    s = w["last_exit_status"]
    if s == 0 and w["restarts"] == 0 and w["state"] not in ("DEAD", "GAVE_UP"):
        return "-"  # no worker has ended yet
    return f"signal {-s}" if s < 0 else f"exit {s}"


def _bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    x = n / 1024
    for unit in ("KiB", "MiB"):
        if x < 1024:
            return f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} GiB"


def format_status(st: dict[str, Any]) -> str:
    running = "running" if st["daemon_running"] else "NOT RUNNING"
    lines = [(f"daemon {st['name']}: pid {st['daemon_pid']} ({running}), {len(st['workers'])} worker(s), "
              f"segments in {st['shm_dir']}")]
    head = ("worker", "state", "pid", "epoch", "restarts", "last exit", "ticks", "rejects", "lanes",
            "cache", "cache bytes", "tokens", "last fault", "heartbeat")
    rows = [head]
    errors = []
    for w in st["workers"]:
        if "error" in w:
            errors.append(f"worker {w['index']}: {w['error']}")
            continue
        fault = w["last_fault"]
        hb = w["heartbeat_age_s"]
        rows.append((
            # A segment outlives a killed daemon: what it says is the last word, not now.
            str(w["index"]), w["state"] if st["daemon_running"] else f"{w['state']} (stale)",
            str(w["pid"] or "-"), str(w["epoch"]), str(w["restarts"]), _exit_text(w),
            str(w["ticks"]), str(w["rejects"]), str(w["live_lanes"]), str(w["cache_entries"]),
            _bytes(w["cache_bytes"]), str(w["tokens_emitted"]),
            f"{fault['name']} lane {fault['lane']:#x}" if fault else "-",
            f"{hb:.2f} s ago" if hb is not None else "-",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines += ["  ".join(f"{v:<{widths[i]}}" for i, v in enumerate(r)).rstrip() for r in rows]
    for w in st["workers"]:
        if w.get("blocked_on_planner_s") is not None:
            lines.append(f"worker {w['index']}: blocked on its planner for {w['blocked_on_planner_s']:.1f} s "
                         "(the event queue is full: the planner is not reading its events)")
        if w.get("queue_resets"):
            lines.append(f"worker {w['index']}: reset {w['queue_resets']} corrupted queue(s)")
    lines += errors
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    try:
        st = read_status(args.name)
    except SegmentError as e:
        print(f"superfluid status: {e}", file=sys.stderr)
        return 2
    if st is None:
        if args.json:  # a JSON consumer gets JSON either way
            print(json.dumps({"name": args.name, "shm_dir": shm_dir(), "daemon_pid": None, "daemon_running": False,
                              "workers": []}, indent=2))
        print(f"superfluid status: no daemon named {args.name!r} (no segment superfluid.{args.name}.* "
              f"in {shm_dir()})", file=sys.stderr)
        return 1
    print(json.dumps(st, indent=2) if args.json else format_status(st))
    if not st["daemon_running"]:
        print(f"superfluid status: daemon {args.name!r} (pid {st['daemon_pid']}) is not running; these segments "
              f"are stale (`superfluid serve --name {args.name}` replaces them)", file=sys.stderr)
        return 1
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("status", help="show a daemon's workers and counters", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", nargs="?", default=DEFAULT_NAME, help=f"the daemon's --name (default {DEFAULT_NAME!r})")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=main)
