"""`superfluid bench NAME --save DIR`: a bench's result as files, not prose.

DIR/NAME.json holds the bench's JSON with what it ran on (CPU, cores,
memory, load before and after, Python, torch, the commit) and how it was
called; DIR/NAME.md a short table of the result's figures, made from the
JSON. Documentation quotes these files, never a figure typed by hand.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_ROWS = 40  # a table a reader takes in; the JSON has everything


def machine() -> dict[str, Any]:
    """What a figure was measured on."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    out: dict[str, Any] = {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
                           "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = torch.__version__
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=Path(__file__).resolve().parent, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def rows(result: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """The result's figures as (dotted key, value): scalars, and scalars one level into dicts."""
    out: list[tuple[str, Any]] = []
    if not isinstance(result, dict):
        return out
    for k, v in result.items():
        key = f"{prefix}{k}"
        if isinstance(v, (int, float, str, bool)) or v is None:
            out.append((key, v))
        elif isinstance(v, dict) and not prefix:
            out += [(f"{key}.{k2}", v2) for k2, v2 in v.items()
                    if isinstance(v2, (int, float, str, bool)) or v2 is None]
    return out


def table(name: str, record: dict[str, Any]) -> str:
    m = record["machine"]
    head = (f"# bench {name}\n\n`superfluid {' '.join(record['argv'])}` on {record['date']}: "
            f"{m['cpu']}, {m['cores']} cores, load {record['load_before']} before, {record['load_after']} after"
            f"{', commit ' + m['commit'] if 'commit' in m else ''}. The figures below are from `{name}.json`.\n\n")
    body = ["| figure | value |", "| --- | --- |"]
    got = rows(record["result"])
    body += [f"| {k} | {v} |" for k, v in got[:MAX_ROWS]]
    if len(got) > MAX_ROWS:
        body.append(f"| ... | {len(got) - MAX_ROWS} more in {name}.json |")
    return head + "\n".join(body) + "\n"


def saving(name: str, func: Callable[[Any], int]) -> Callable[[Any], int]:
    """`func` (a bench's main) that, given args.save, runs it with --json and writes its result files."""

    def run(args: Any) -> int:
        if not getattr(args, "save", None):
            return func(args)
        args.json = True
        load_before = [round(x, 2) for x in os.getloadavg()]
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = func(args)
        text = buf.getvalue()
        sys.stdout.write(text)
        try:
            result = json.loads(text)
        except ValueError:
            print(f"superfluid bench {name}: --save: the bench printed no JSON; nothing saved", file=sys.stderr)
            return rc or 1
        record = {"bench": name, "argv": ["bench", *sys.argv[sys.argv.index(name):]] if name in sys.argv
                  else ["bench", name], "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                  "exit_status": rc, "load_before": load_before,
                  "load_after": [round(x, 2) for x in os.getloadavg()], "machine": machine(), "result": result}
        out = Path(args.save)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
        (out / f"{name}.md").write_text(table(name, record))
        print(f"superfluid bench {name}: saved {out / (name + '.json')} and {name}.md", file=sys.stderr)
        return rc

    return run
