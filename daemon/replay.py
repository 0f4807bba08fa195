"""`superfluid replay DIR`: re-run a flight record (docs/recorder.md) and
compare every outcome with the recorded one, bit for bit.

    superfluid replay DIR [--worker I] [--until TICK] [--model DIR] [--json]

Each epoch of each worker's record replays from its own start on a fresh
in-process executor, built as the worker built its own (worker.py
build_runtime and make_executor over the recorded argv), in the world
replay_world.py rebuilds from the record; replay_diff.py compares. Prints
"N ticks replayed, identical" (exit 0), or the first tick, message and
field that differ (exit 1). A record it will not run — no such folder,
another record format or ABI version, another model — is one line naming
the file and field, exit 2; so is a record no epoch of which can be
replayed (an epoch whose first file was dropped to stay within
--record-bytes is skipped, and said so).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from superfluid.abi import ABI_VERSION
from superfluid.abi.plan_codec import plan_seq_of
from superfluid.daemon import record_format as rf
from superfluid.daemon.replay_diff import Writes, first_difference, show
from superfluid.daemon.replay_world import Refused, Started, new_tmp, run_plan, start

EXIT_IDENTICAL, EXIT_DIFFERS, EXIT_REFUSED = 0, 1, 2
_PATHS = {rf.PATH_EMPTY: "tick_empty", rf.PATH_TICK: "tick", rf.PATH_UNDECODED: "refused by decode_plan"}


@dataclass
class Difference:
    worker: int
    epoch: int
    tick: int  # the plan's place among the replayed ones (1-based); 0: an op between ticks
    plan_seq: int | None
    message: str  # TickEvents, tick_empty's TickMemCounters, OpCompletion, or what the call read
    field: str
    recorded: Any
    replayed: Any
    file: str
    offset: int

    def line(self) -> str:
        where = f"tick {self.tick} (plan_seq {self.plan_seq})" if self.tick else "an op"
        return (f"worker {self.worker} epoch {self.epoch}: {where} differs: {self.message}.{self.field}: "
                f"recorded {show(self.recorded)}, replayed {show(self.replayed)} "
                f"({os.path.basename(self.file)} at byte {self.offset})")


@dataclass
class Epoch:
    """One epoch's frames, whole from its start, or why it cannot be replayed."""

    epoch: int
    header: dict[str, Any]
    first_file: str
    frames: list[tuple[str, rf.Frame]] = field(default_factory=list)
    skipped: str | None = None
    ticks: int = 0
    ops: int = 0
    incomplete: bool = False  # the last plan or op has no outcome: the worker died in it
    next_part: int = 0  # the part the epoch's next file must be


def load_worker(worker_dir: str) -> list[Epoch]:
    """A worker folder's epochs, in order. Refused for a file of another
    format or ABI version (naming it)."""
    epochs: list[Epoch] = []
    for _, path in rf.segment_files(worker_dir):
        try:
            read = rf.read_file(path)
        except ValueError as e:
            raise Refused(str(e)) from None
        if not read.frames:
            continue  # a worker killed as it started this file: nothing in it
        if read.frames[0].kind != rf.HEADER:
            raise Refused(f"{path}: does not start with a header record")
        h = read.frames[0].body
        if h.get("format") != rf.FORMAT_VERSION:
            raise Refused(f"{path}: format: record format {h.get('format')}, this superfluid reads "
                          f"{rf.FORMAT_VERSION}")
        if h.get("abi_version") != ABI_VERSION:
            raise Refused(f"{path}: abi_version: recorded under ABI v{h.get('abi_version')}, this build is "
                          f"ABI v{ABI_VERSION}")
        last = epochs[-1] if epochs else None
        if (last is None or (last.epoch, last.header.get("pid")) != (h["epoch"], h.get("pid"))
                or h["part"] != last.next_part):
            last = Epoch(h["epoch"], dict(h), path)
            if h["part"] != 0:
                last.skipped = (f"its start is gone: {os.path.basename(path)} continues epoch {h['epoch']} "
                                f"(part {h['part']}); its earlier files were dropped to stay within "
                                f"--record-bytes {h.get('record_bytes')}")
            epochs.append(last)
        last.next_part = h["part"] + 1
        last.frames += [(path, fr) for fr in read.frames[1:]]
    return epochs


def check_model(epochs: list[Epoch], model: str | None) -> None:
    """Refused when the model a replay would load is not the recorded one."""
    seen: dict[str | None, dict[str, str]] = {}
    for ep in epochs:
        if ep.skipped:
            continue
        rec = ep.header["model"]
        path = model if model is not None and rec["path"] is not None else rec["path"]
        if path is not None and not os.path.isdir(path):
            raise Refused(f"{ep.first_file}: model.path: {path} is no directory here (give --model DIR)")
        if path not in seen:
            seen[path] = rf.model_identity(path)
        diff = rf.identity_difference(rec["identity"], seen[path])
        if diff:
            raise Refused(f"{ep.first_file}: model.identity: {path} is not the recorded model ({diff})")


# ------------------------------------------------------------------ run


@dataclass
class WorkerResult:
    worker: int
    epochs: list[Epoch]
    difference: Difference | None = None

    @property
    def ticks(self) -> int:
        return sum(ep.ticks for ep in self.epochs)

    @property
    def ops(self) -> int:
        return sum(ep.ops for ep in self.epochs)


class _Epoch:
    """One epoch's replay: frames in, the first difference out."""

    def __init__(self, ep: Epoch, s: Started, worker: int, ticks_before: int):
        self.ep, self.s, self.worker, self.before = ep, s, worker, ticks_before

    def differs(self, fr: tuple[str, rf.Frame], message: str, found: tuple[str, Any, Any],
                seq: int | None, tick: int) -> Difference:
        path, frame = fr
        return Difference(self.worker, self.ep.epoch, tick, seq, message, found[0], found[1], found[2], path,
                          frame.offset)

    def _feed(self, prompts: list[Any], reads: list[Any]) -> None:
        s = self.s
        s.rings.feed(prompts, reads)
        s.clock.feed(reads[0])
        if s.state_dir is not None:
            s.state_dir.calls = list(reads[4])

    def _read_back(self, reads: list[Any]) -> tuple[str, Any, Any] | None:
        """Whether the call read what the worker's did, as often."""
        s = self.s
        over = s.rings.overrun + (s.state_dir.overrun if s.state_dir is not None else [])
        if over:
            return ("a read the worker did not make", None, over[0])
        if s.clock.at != len(reads[0]) or s.clock.over:
            return ("clock readings", len(reads[0]), s.clock.at + s.clock.over)
        for name, left in (("yield_requested", s.rings.yields), ("latency_wanted", s.rings.latency)):
            if left:
                return (f"{name} readings", "more", f"{len(left)} fewer")
        if s.state_dir is not None and s.state_dir.calls:
            return ("state-directory calls", "more", f"{len(s.state_dir.calls)} fewer")
        return None

    def run(self, until: int | None) -> Difference | None:
        ep, ex, frames = self.ep, self.s.ex, self.ep.frames
        i = 0
        while i < len(frames):
            path, fr = frames[i]
            if fr.kind == rf.SESSION:
                ex.begin_session(fr.body[0])
            elif fr.kind == rf.FLUSH:
                ex.pending.take_completions()
            elif fr.kind in (rf.OP, rf.PLAN):
                want = rf.OP_DONE if fr.kind == rf.OP else rf.DONE
                if i + 1 == len(frames):
                    ep.incomplete = True  # the worker died in this call
                    break
                if frames[i + 1][1].kind != want:
                    raise Refused(f"{path}: a {rf.KINDS[fr.kind]} record at byte {fr.offset} is followed by "
                                  f"{rf.KINDS.get(frames[i + 1][1].kind, '?')}, not its outcome")
                if fr.kind == rf.PLAN and until is not None and self.before + ep.ticks >= until:
                    return None
                d = (self._op if fr.kind == rf.OP else self._plan)(frames[i], frames[i + 1][1].body)
                if d is not None:
                    return d
                i += 2
                continue
            else:
                raise Refused(f"{path}: an unexpected {rf.KINDS.get(fr.kind, fr.kind)} record at byte {fr.offset}")
            i += 1
        return None

    def _op(self, fr: tuple[str, rf.Frame], done: list[Any]) -> Difference | None:
        completion, reads = done
        self._feed([], reads)
        got = self.s.ex.op(fr[1].body[0], queue=True)
        self.ep.ops += 1
        found = first_difference(completion, got, Writes(), Writes())
        if found:
            return self.differs(fr, "OpCompletion", found, None, 0)
        found = self._read_back(reads)
        return self.differs(fr, "the op's reads", found, None, 0) if found else None

    def _plan(self, fr: tuple[str, rf.Frame], done: list[Any]) -> Difference | None:
        message, try_empty, prompts = fr[1].body
        rpath, outcome, reads, tokens, logits = done
        self._feed(prompts, reads)
        path, got = run_plan(self.s, message, try_empty)
        self.ep.ticks += 1
        tick, seq = self.before + self.ep.ticks, plan_seq_of(message)
        if path != rpath:
            return self.differs(fr, "the plan's path", ("path", _PATHS[rpath], _PATHS[path]), seq, tick)
        kind = "TickMemCounters" if path == rf.PATH_EMPTY else "TickEvents"
        recorded = Writes.recorded(self.ep.header["rings"]["tokens"][0], tokens, logits)
        found = first_difference(outcome, got, recorded, self.s.rings.written())
        if found:
            return self.differs(fr, kind, found, seq, tick)
        found = self._read_back(reads)
        return self.differs(fr, "the tick's reads", found, seq, tick) if found else None


def find_workers(root: str, worker: int | None) -> list[tuple[int, str]]:
    if not os.path.isdir(root):
        raise Refused(f"{root}: no such directory")
    dirs = rf.worker_dirs(root)
    if not dirs and rf.segment_files(root):  # a worker's own folder
        first = rf.read_file(rf.segment_files(root)[0][1])
        dirs = [(first.frames[0].body.get("worker", 0) if first.frames else 0, root)]
    if not dirs:
        raise Refused(f"{root}: holds no record (no worker-<i> folder of {rf.SUFFIX} files)")
    if worker is not None:
        dirs = [d for d in dirs if d[0] == worker]
        if not dirs:
            raise Refused(f"{root}: --worker {worker}: no such worker in the record")
    return dirs


def replay(root: str, *, worker: int | None = None, until: int | None = None,
           model: str | None = None) -> list[WorkerResult]:
    """Replay the record under `root`, each worker up to its first difference.
    Refused (before anything runs) for a record it will not run."""
    loaded = [(i, load_worker(d)) for i, d in find_workers(root, worker)]
    for _, epochs in loaded:
        check_model(epochs, model)
    runnable = [ep for _, epochs in loaded for ep in epochs if ep.skipped is None]
    if not runnable:
        ep = next((ep for _, epochs in loaded for ep in epochs), None)
        raise Refused(f"{ep.first_file}: not replayable: {ep.skipped}" if ep else f"{root}: the record is empty")
    out = []
    for index, epochs in loaded:
        res = WorkerResult(index, epochs)
        out.append(res)
        for ep in epochs:
            if ep.skipped is not None:
                continue
            if until is not None and res.ticks >= until:
                break
            with new_tmp() as tmp:
                s = start(ep.header, ep.first_file, model, tmp)
                try:
                    res.difference = _Epoch(ep, s, index, res.ticks).run(until)
                finally:
                    s.runtime.close()
            if res.difference is not None:
                break
    return out


# ------------------------------------------------------------------ CLI


def _epoch_json(ep: Epoch) -> dict[str, Any]:
    return {"epoch": ep.epoch, "file": ep.first_file, "ticks": ep.ticks, "ops": ep.ops,
            "incomplete": ep.incomplete, "skipped": ep.skipped}


def _jsonable(v: Any) -> Any:
    try:
        json.dumps(v)
    except (TypeError, ValueError):
        return show(v)
    return v


def _summary(results: list[WorkerResult]) -> dict[str, Any]:
    diff = next((r.difference for r in results if r.difference is not None), None)
    return {
        "identical": diff is None, "ticks": sum(r.ticks for r in results), "ops": sum(r.ops for r in results),
        "workers": [{"worker": r.worker, "ticks": r.ticks, "ops": r.ops, "epochs": [_epoch_json(e) for e in r.epochs],
                     "difference": None if r.difference is None else
                     {**asdict(r.difference), "recorded": _jsonable(r.difference.recorded),
                      "replayed": _jsonable(r.difference.replayed)}} for r in results],
    }


def _print(results: list[WorkerResult]) -> None:
    out = sys.stdout
    for r in results:
        ran = [ep for ep in r.epochs if ep.skipped is None and (ep.ticks or ep.ops)]
        again = len({ep.epoch for ep in ran}) < len(ran)  # daemons one after another on one DIR
        names = [f"{ep.epoch} (pid {ep.header.get('pid')})" if again else str(ep.epoch) for ep in ran]
        print(f"worker {r.worker}: {r.ticks} ticks and {r.ops} ops replayed (epochs {', '.join(names) or 'none'})",
              file=out)
        for ep in r.epochs:
            if ep.skipped is not None:
                print(f"  epoch {ep.epoch} skipped: {ep.skipped}", file=out)
            elif ep.incomplete:
                print(f"  epoch {ep.epoch} ends in a call with no recorded outcome (the worker died in it): "
                      "replayed up to it", file=out)
    total = sum(r.ticks for r in results)
    diff = next((r.difference for r in results if r.difference is not None), None)
    print(f"{total} ticks replayed, identical" if diff is None else diff.line(), file=out)


def main(args: argparse.Namespace) -> int:
    try:
        results = replay(args.dir, worker=args.worker, until=args.until, model=args.model)
    except Refused as e:
        print(f"superfluid replay: {e}", file=sys.stderr)
        if args.json:
            print(json.dumps({"refused": str(e)}))
        return EXIT_REFUSED
    summary = _summary(results)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print(results)
    return EXIT_IDENTICAL if summary["identical"] else EXIT_DIFFERS


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("replay", help="re-run a flight record (serve --record) and compare it bitwise",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", metavar="DIR", help="the record: serve --record's DIR (or one worker-<i> folder of it)")
    p.add_argument("--worker", type=int, help="replay this worker's record only (default: every worker's)")
    p.add_argument("--until", type=int, metavar="TICK", help="stop after this many ticks of each worker")
    p.add_argument("--model", metavar="DIR", help="load the model from here (default: where the worker did); "
                                                  "its identity must be the recorded one")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=main)
