"""Tests only: a process that pays the worker's imports once (torch alone is
~2 s here) and forks worker processes on request, so that a test's restarts
cost what a fork costs. Each forked child runs the worker's own main(), as
`python -m superfluid.daemon.worker ARGS` would.

Each stdin line is a JSON command, each answer one JSON line:
  ["start", argv] -> {"pid": pid}
  ["poll", pid]   -> {"status": exit code, -signal, or null while it runs}
  ["reap", pid]   -> {"status": ...} once it has ended
End of input: the zygote leaves (its children are the caller's to stop first).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import superfluid.daemon.worker as worker
import superfluid.daemon.worker_loop  # noqa: F401
import superfluid.engine.fake  # noqa: F401  the imports a worker pays, paid once here


def _child(argv: list[str]) -> None:
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # the zygote's stdout carries answers only
    code = 1
    try:
        code = worker.main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code or 0)


def _status(pid: int, flags: int) -> int | None:
    done, st = os.waitpid(pid, flags)
    return os.waitstatus_to_exitcode(st) if done else None


def main() -> None:
    for line in sys.stdin:
        cmd, arg = json.loads(line)
        if cmd == "start":
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _child(arg)
            answer = {"pid": pid}
        elif cmd == "poll":
            answer = {"status": _status(arg, os.WNOHANG)}
        elif cmd == "reap":
            answer = {"status": _status(arg, 0)}
        else:
            answer = {"error": f"unknown command {cmd!r}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
