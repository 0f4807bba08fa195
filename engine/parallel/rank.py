"""A follower rank's process: `python -P -m superfluid.engine.parallel.rank SPEC`.

SPEC is the JSON of a RankSpec (launch.py writes it). The process joins the
group, loads its shard, says "ready" on stdout, then follows the leader's
messages until the leader says stop (exit 0). Anything else ends it with
status 3: a collective that timed out (a rank died or stopped), the leader
gone, a message it could not apply. Whoever started it restarts the group.
"""

from __future__ import annotations

import json
import sys

from superfluid.engine.parallel.launch import RankSpec, join_group, load_shard


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m superfluid.engine.parallel.rank SPEC_JSON", file=sys.stderr)
        return 2
    spec = RankSpec(**json.loads(argv[0]))
    from superfluid.engine.parallel.ranks import follow, pid_alive

    group = join_group(spec)
    try:
        tp = load_shard(spec, group)
        print("ready", flush=True)
        follow(tp, spec.n_blocks, spec.page, pid_alive(spec.leader_pid) if spec.leader_pid else (lambda: True))
    except Exception as e:  # noqa: BLE001 - any failure ends the rank; the group restarts
        print(f"superfluid tp rank {spec.rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 3
    finally:
        group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
