"""A follower rank's process: `python -P -m superfluid.engine.parallel.rank SPEC`.

SPEC is the JSON of a RankSpec (launch.py). run_follower loads the rank's
shard, says "ready" on stdout, joins the group, checks with every rank that
they all loaded the same checkpoint with the same options, then follows the leader's messages until the leader says stop
(status 0). Anything else ends it with status 3: a collective that timed
out (a rank died or stopped), the leader gone, a message it could not
apply. Whoever started it restarts the whole group.
"""

from __future__ import annotations

import json
import sys

from superfluid.engine.parallel.launch import RankSpec, build_model, digest, join_group, read_shard

EXIT_GROUP = 5  # daemon/worker_exits.py names it


def run_follower(spec: RankSpec) -> int:
    from superfluid.engine.parallel.ranks import follow, pid_alive

    group = None
    try:
        read = read_shard(spec)
        print("ready", flush=True)
        group = join_group(spec)
        tp = build_model(spec, read, group)
        group.link.barrier(digest(spec))
        follow(tp, spec.n_blocks, spec.page, pid_alive(spec.leader_pid) if spec.leader_pid else (lambda: True))
    except Exception as e:  # noqa: BLE001 - any failure ends the rank; the group restarts
        print(f"superfluid tp rank {spec.rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return EXIT_GROUP
    finally:
        if group is not None:
            group.close()
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m superfluid.engine.parallel.rank SPEC_JSON", file=sys.stderr)
        return 2
    return run_follower(RankSpec(**json.loads(argv[0])))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
