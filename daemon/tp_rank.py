"""A tensor-parallel follower the daemon starts (daemon/tp_ranks.py).

    python -m superfluid.daemon.tp_rank --rank R --leader-pid PID --tp-init METHOD --tp-shm PATH
        [the worker's runtime options: --model, --tp, --kv-cells, --dtype, ...]

It takes the worker's very options, so every rank computes the same shard
plan, pool shape and sequence limit. Exit 0 when the leader says stop,
5 when the group broke (the daemon restarts it), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    from superfluid.daemon.worker import EXIT_BAD_ARGS, add_runtime_args, runtime_options

    p = argparse.ArgumentParser(prog="superfluid-tp-rank", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--leader-pid", type=int, required=True)
    p.add_argument("--tp-init", default="", help="where a machine's ranks meet (across machines: --master-addr)")
    p.add_argument("--tp-shm", default="")
    add_runtime_args(p)
    args = p.parse_args(argv)
    # The daemon signals the group; a group-wide SIGTERM or SIGINT must not end a rank mid-step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from superfluid.engine.parallel.launch import rank_spec
    from superfluid.engine.parallel.rank import run_follower
    from superfluid.engine.tiny import default_model_dir

    model = args.model or str(default_model_dir())
    try:
        opts = runtime_options(args, model)
        tp, tp_opts = opts.pop("tp", 1), dict(opts.pop("tp_options", {}))
        init, shm = tp_opts.pop("join")
        tp_opts.pop("nnodes", None)
        if not 0 < args.rank < tp:
            raise ValueError(f"--rank {args.rank}: a follower of a group of {tp} is 1..{tp - 1}")
        import torch

        dtype = opts.pop("dtype", None)
        spec = rank_spec(model, tp, args.rank, init, shm, backend=args.backend, leader_pid=args.leader_pid,
                         dtype=getattr(torch, dtype) if dtype else None, **tp_opts, **opts)
    except ValueError as e:
        print(f"superfluid tp rank {args.rank}: {e}", file=sys.stderr)
        return EXIT_BAD_ARGS
    return run_follower(spec)


if __name__ == "__main__":
    sys.exit(main())
