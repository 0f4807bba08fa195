"""`superfluid serve`: run the daemon in the foreground.

    superfluid serve [--model DIR | --fake] [--backend torch|triton] [--workers N] [--name NAME]
        [--kv-cells N] [--page N] [--state-bytes N] [--max-batch N] ... [--fault-injection]
        [--restart-backoff S] [--restart-backoff-max S] [--crash-loop N/WINDOW] [--stop-timeout S]
        [--metrics-port PORT]

Creates a segment per worker (/dev/shm/superfluid.NAME.<i>, or under
$SUPERFLUID_SHM_DIR), starts the workers, restarts one that dies (after a
backoff doubling from --restart-backoff), gives up on one that fails
--crash-loop times within the window. SIGTERM or SIGINT: stop the workers,
remove the segments, exit 0. SIGHUP: retry the workers that gave up.
Before anything starts, the checkpoint (config, every tensor's header) and
the options are checked, and the memory they imply against the machine
(daemon/preflight.py). Exits 1 when every worker gave up; 2 on a bad option,
a checkpoint that cannot load or sizes the machine cannot hold (at once, one
line naming it), or a worker that failed to load for a reason a restart
cannot change (its message is in the log).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys

from superfluid.daemon.status import DEFAULT_NAME
from superfluid.daemon.watchdog import DEFAULT_TICK_TIMEOUT_S
from superfluid.daemon.worker import add_runtime_args
from superfluid.rings.naming import NAME_RE

log = logging.getLogger("superfluid.daemon")


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{s}: must be >= 1")
    return v


MAX_SECONDS = 86400.0  # a day: beyond it a timer overflows select() and timestamps


def _seconds(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected a number of seconds") from None
    if not 0 <= v <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{s}: must be a number of seconds in [0, {MAX_SECONDS:.0f}]")
    return v


def _port(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected a TCP port") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"{s}: a port is 0-65535 (0: any free port)")
    return v


def _name(s: str) -> str:
    if not NAME_RE.match(s):
        raise argparse.ArgumentTypeError(f"{s!r}: 1-31 characters of [A-Za-z0-9_.-], starting with a letter "
                                         "or digit (it names the segments)")
    return s


def parse_crash_loop(s: str) -> tuple[int, float]:
    """'5/60' -> (5, 60.0): give up after 5 failures within 60 s."""
    try:
        n, window = s.split("/")
        out = int(n), float(window)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected FAILURES/SECONDS, e.g. 5/60") from None
    if out[0] < 1 or not 0 < out[1] <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{s!r}: needs at least 1 failure in a positive window")
    return out


def runtime_argv(args: argparse.Namespace) -> list[str]:
    """The worker options (add_runtime_args) that differ from their defaults."""
    p = argparse.ArgumentParser(add_help=False)
    add_runtime_args(p)
    out: list[str] = []
    for a in p._actions:
        v = getattr(args, a.dest, a.default)
        if v is None or v == a.default:
            continue
        opt = max(a.option_strings, key=len)
        out += [opt] if isinstance(a, argparse._StoreTrueAction) else [opt, str(v)]
    return out


def main(args: argparse.Namespace) -> int:
    from superfluid.daemon.preflight import Refused, check
    from superfluid.daemon.supervisor import Daemon, segment_config_for
    from superfluid.rings.errors import SegmentError

    logging.basicConfig(level=getattr(logging, args.log_level), stream=sys.stderr,
                        format="%(asctime)s superfluid[%(process)d] %(levelname)s %(message)s")
    if args.fake:
        if args.model:
            print("superfluid serve: --fake and --model exclude each other", file=sys.stderr)
            return 2
    else:
        if args.model is None:
            from superfluid.engine.tiny import default_model_dir

            args.model = str(default_model_dir())
        if not os.path.isdir(args.model):
            print(f"superfluid serve: --model {args.model}: no such directory", file=sys.stderr)
            return 2
        args.model = os.path.abspath(args.model)  # the workers get the very same checkpoint
    if args.record is not None:  # the workers' flight records (docs/recorder.md)
        args.record = os.path.abspath(args.record)
        try:
            os.makedirs(args.record, mode=0o700, exist_ok=True)
            if not os.access(args.record, os.W_OK | os.X_OK):
                raise PermissionError(13, "not writable")
        except OSError as e:
            print(f"superfluid serve: --record {args.record}: {e.strerror}", file=sys.stderr)
            return 2
    if args.node_rank > 0:  # another machine's share of the --tp ranks: no segment, no worker
        from superfluid.daemon.tp_node import serve_ranks
        from superfluid.daemon.worker import runtime_options
        from superfluid.engine.sizing import plan_load

        try:
            options = {} if args.fake else runtime_options(args, args.model)
            if options.get("tp", 1) == 1:
                raise ValueError(f"--node-rank {args.node_rank}: a machine past node 0 runs --tp ranks of a model")
            plan_load(args.model, args.backend, **options)  # what node 0 checks: the degree, the checkpoint
        except (OSError, ValueError) as e:
            print(f"superfluid serve: {e}", file=sys.stderr)
            return 2
        return serve_ranks(args, runtime_argv(args))
    # Until the daemon handles signals itself (Daemon.start), a SIGTERM ends
    # the checks at once, as a stop: nothing is made yet but the state directory.
    signal.signal(signal.SIGTERM, _stop_now)
    made_state_dir = False
    try:
        try:
            # Every worker would fail the same way and crash-loop: say it once, up front.
            ok = check(args)
        except Refused as e:
            print(f"superfluid serve: {e}", file=sys.stderr)
            return 2
        made_state_dir = ok.made_state_dir
        try:
            daemon = Daemon(
                args.name, runtime_argv(args), workers=args.workers,
                segment_config=segment_config_for(ok.vocab, args.max_batch),
                fault_injection=args.fault_injection,
                restart_backoff=args.restart_backoff, restart_backoff_max=args.restart_backoff_max,
                crash_loop=args.crash_loop, stop_timeout=args.stop_timeout, metrics_port=args.metrics_port,
                tp=args.tp, nnodes=args.nnodes, tick_timeout=args.tick_timeout)
            daemon.start()
        except (SegmentError, ValueError) as e:  # e.g. --name of a daemon that runs: refused, as options are
            print(f"superfluid serve: {e}", file=sys.stderr)
            return 2
        except OSError as e:
            print(f"superfluid serve: {e}", file=sys.stderr)
            return 1
        return daemon.serve_forever()
    finally:
        if made_state_dir:
            with contextlib.suppress(OSError):  # kept when an export left a file in it
                os.rmdir(args.state_dir)


def _stop_now(signum: int, frame: object) -> None:
    raise SystemExit(0)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the daemon: segments, workers, restarts", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_runtime_args(p)
    p.add_argument("--workers", type=_positive_int, default=1, help="worker processes (default 1)")
    p.add_argument("--name", type=_name, default=DEFAULT_NAME,
                   help=f"the daemon's name, in segment names (default {DEFAULT_NAME!r})")
    p.add_argument("--fault-injection", action="store_true",
                   help="allow the fault ops (INJECT_FAULT, INSTALL_FAULTS, ...) and --fault-schedule (tests)")
    p.add_argument("--restart-backoff", type=_seconds, default=1.0,
                   help="seconds before restarting a dead worker, doubled per recent failure (default 1)")
    p.add_argument("--restart-backoff-max", type=_seconds, default=30.0, help="cap on that backoff (default 30)")
    p.add_argument("--crash-loop", type=parse_crash_loop, default=(5, 60.0), metavar="N/WINDOW",
                   help="give up on a worker after N failures within WINDOW seconds (default 5/60)")
    p.add_argument("--tick-timeout", type=_seconds, default=DEFAULT_TICK_TIMEOUT_S, metavar="S",
                   help="restart a worker whose tick or op has held its loop for S seconds (a hang); above the "
                        f"longest tick the model runs (default {DEFAULT_TICK_TIMEOUT_S:g}; 0: no watchdog)")
    p.add_argument("--stop-timeout", type=_seconds, default=10.0,
                   help="seconds workers get to stop before SIGKILL (default 10)")
    p.add_argument("--metrics-port", type=_port, help="serve Prometheus metrics on 127.0.0.1:PORT (0: any free port)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.set_defaults(func=main)
