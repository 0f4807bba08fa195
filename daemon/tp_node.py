"""`superfluid serve --tp N --nnodes M --node-rank K` on a machine K > 0: its ranks only.

Node 0's daemon hosts the worker (the leader, rank 0), its segment and its
first N/M ranks; this machine runs ranks K*N/M .. (K+1)*N/M - 1, which meet
the leader at --master-addr:--master-port through gloo. The group is
fail-stop across machines too: a rank here that exits (its group broke: the
leader restarted, a rank elsewhere died) ends every rank here, and they all
start again to join the leader's next group; one that dies makes the
leader's next collective fail, which restarts the group on node 0. Restarts
back off as the daemon's do (--restart-backoff, --restart-backoff-max), and
after --crash-loop N/WINDOW failures this process gives up (exit 1): a rank
that can never run here must not spin. SIGTERM or SIGINT ends the ranks and
this process (exit 0).
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import select
import signal
import subprocess
import sys
import time

from superfluid.daemon.worker_exits import describe_exit, die_with_parent
from superfluid.daemon.worker_life import restart_delay

log = logging.getLogger("superfluid.daemon")



def ranks_of(args: argparse.Namespace) -> range:
    per = args.tp // args.nnodes
    return range(args.node_rank * per, (args.node_rank + 1) * per)


def serve_ranks(args: argparse.Namespace, worker_args: list[str]) -> int:
    """Run this machine's ranks until SIGTERM/SIGINT; restart them all when one ends."""
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    ranks = ranks_of(args)
    log.info("node %d of %d: tp ranks %d..%d of %d, leader at %s:%d", args.node_rank, args.nnodes, ranks.start,
             ranks.stop - 1, args.tp, args.master_addr, args.master_port)
    group = 0
    failures: collections.deque[float] = collections.deque()
    n_fail, window = args.crash_loop
    while not stop["now"]:
        group += 1
        procs = {}
        for r in ranks:
            cmd = [sys.executable, "-P", "-m", "superfluid.daemon.tp_rank", "--rank", str(r), "--leader-pid", "0",
                   *worker_args]
            p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 preexec_fn=die_with_parent(os.getpid()))  # noqa: PLW1509
            procs[os.pidfd_open(p.pid)] = (r, p)
            log.info("tp rank %d started: pid %d (group %d here)", r, p.pid, group)
        ended = None
        while ended is None and not stop["now"]:
            try:
                ready, _, _ = select.select(list(procs), [], [], 0.5)
            except InterruptedError:
                continue
            if ready:
                ended = procs[ready[0]]
        for fd, (r, p) in procs.items():
            if p.poll() is None:
                p.kill()
            status = p.wait()
            os.close(fd)
            if ended is not None and r == ended[0]:
                log.warning("tp rank %d (pid %d) %s: restarting this node's ranks", r, p.pid, describe_exit(status))
        if stop["now"]:
            break
        now = time.monotonic()
        failures.append(now)
        while failures and failures[0] < now - window:
            failures.popleft()
        if len(failures) >= n_fail:
            log.error("this node's ranks failed %d times in %g s; giving up", len(failures), window)
            return 1
        time.sleep(restart_delay(len(failures), args.restart_backoff, args.restart_backoff_max))
    log.info("node %d stopped", args.node_rank)
    return 0
