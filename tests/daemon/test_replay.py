"""The flight recorder and `superfluid replay` against live daemons: the
demo's workload recorded through a kill -9 replays identical, both epochs;
one prompt token edited in the record is reported at the first tick it
changes (the negative control); a worker killed mid-tick leaves a record
whose replay up to its last whole tick is identical; a record bounded by
--record-bytes drops its oldest files and still replays what it can (and
refuses what it cannot, naming the file); a record of another ABI version
or another model is refused."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from superfluid.cli import main as cli_main
from superfluid.client import Client
from superfluid.client.planner import Planner
from superfluid.daemon import record_format as rf
from superfluid.daemon.replay import Refused, replay
from superfluid.daemon.supervisor import Daemon
from superfluid.engine.tiny import default_model_dir
from superfluid.testing.daemon import FAKE_WORKER, wait_for


@contextlib.contextmanager
def daemon(name: str, *worker_args: str, **kw) -> Iterator[Daemon]:
    d = Daemon(name, list(worker_args), workers=1, restart_backoff=0.05, restart_backoff_max=0.2,
               crash_loop=(100, 60.0), handle_signals=False, **kw)
    d.start()
    loop = threading.Thread(target=d.serve_forever, daemon=True)
    loop.start()
    try:
        yield d
    finally:
        d.stop()
        loop.join(30)


def kill_worker(d: Daemon) -> None:
    pid = d.worker_pid(0)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)


def greedy(n: int, seed: int, prompt: int = 24, new: int = 10) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(256) for _ in range(prompt)], new) for _ in range(n)]


def drive(name: str, reqs: list[tuple[list[int], int]], *, after_plan=None) -> Planner:
    """Run `reqs` through the reference planner; after_plan(n) is called after the n-th plan is sent."""
    with Client.connect(name, 0, timeout=120) as c:
        p = Planner(c, prefill_token_budget=64, decode_grant=3)
        if after_plan is not None:
            submit, sent = c.submit, [0]

            def submit_then(plan, timeout=None):
                seq = submit(plan, timeout)
                sent[0] += 1
                after_plan(sent[0])
                return seq

            c.submit = submit_then  # type: ignore[method-assign]
        for prompt, new in reqs:
            p.submit(prompt, new, stop_at_eos=False)
        p.run_until_done(120)
        return p


def epochs_of(results) -> list[dict]:
    (w,) = results
    return [{"epoch": e.epoch, "ticks": e.ticks, "incomplete": e.incomplete, "skipped": e.skipped} for e in w.epochs]


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli_main(["replay", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# ------------------------------------------------- the demo, through a kill


@pytest.fixture(scope="module")
def demo_record(tmp_path_factory) -> Path:
    """The demo's workload on the tiny model, recorded, worker 0 SIGKILLed mid-run."""
    from superfluid.daemon.worker import model_vocab
    from superfluid.demo import _run, workload
    from superfluid.rings.layout import SegmentConfig

    rec = tmp_path_factory.mktemp("demo") / "rec"
    model = str(default_model_dir())
    vocab = model_vocab(model)
    with daemon(f"rdemo{os.getpid()}", "--model", model, "--record", str(rec),
                segment_config=SegmentConfig(logits_floats=max(1 << 20, 2 * 64 * vocab))) as d:
        _, report, notes, drafts = _run(d.name, workload(vocab, 8), "recorded", 120, d, budget=256, grant=8)
    assert notes and report.stats.restarts == 1 and drafts, notes
    return rec


def test_the_demo_recorded_through_a_kill_replays_identical(demo_record, capsys):
    results = replay(str(demo_record))
    assert results[0].difference is None, results[0].difference.line()
    eps = epochs_of(results)
    assert [e["epoch"] for e in eps] == [1, 2] and all(e["ticks"] > 0 and e["skipped"] is None for e in eps), eps
    code, out, _ = cli(capsys, str(demo_record))
    assert code == 0 and out.rstrip().endswith(f"{results[0].ticks} ticks replayed, identical"), out


def test_until_stops_after_that_many_ticks(demo_record):
    (w,) = replay(str(demo_record), until=5)
    assert w.difference is None and w.ticks == 5


def _edit_prompt_token(src: Path, dst: Path, nth: int) -> int:
    """Copy the record and add 1 to the last token of the nth prompt it holds; the tick of that plan."""
    shutil.copytree(src, dst)
    path = rf.segment_files(str(dst / "worker-0"))[0][1]
    frames = [(f.kind, f.body) for f in rf.read_file(path).frames]
    ticks = seen = 0
    for kind, body in frames:
        if kind != rf.PLAN:
            continue
        ticks += 1
        if body[2]:
            seen += 1
            if seen == nth:
                entry = body[2][0]
                toks = bytearray(entry[3])
                toks[-4] = (toks[-4] + 1) % 250
                entry[3] = bytes(toks)
                rf.write_file(path, frames)
                return ticks
    raise AssertionError(f"the record holds fewer than {nth} plans with prompts")


def test_one_prompt_token_edited_is_the_first_difference(demo_record, tmp_path, capsys):
    """The negative control: the replay is not blind."""
    edited = tmp_path / "edited"
    tick = _edit_prompt_token(demo_record, edited, 2)
    (w,) = replay(str(edited))
    d = w.difference
    assert d is not None, "an edited prompt token replayed identical"
    assert d.epoch == 1 and d.tick >= tick and d.message == "TickEvents" and d.field, d.line()
    assert w.ticks == d.tick  # nothing replayed past it
    code, out, _ = cli(capsys, str(edited))
    assert code == 1 and f"tick {d.tick} (plan_seq {d.plan_seq}) differs: TickEvents.{d.field}" in out, out


def test_an_emitted_token_edited_in_the_record_is_named(demo_record, tmp_path):
    """The tokens an emit wrote to the ring are compared, not just its reference."""
    edited = tmp_path / "edited"
    shutil.copytree(demo_record, edited)
    path = rf.segment_files(str(edited / "worker-0"))[0][1]
    frames = [(f.kind, f.body) for f in rf.read_file(path).frames]
    tick = 0
    for kind, body in frames:
        tick += kind == rf.PLAN
        if kind == rf.DONE and body[3][1]:
            data = body[3][1]
            body[3][1] = data[:-4] + (int.from_bytes(data[-4:], "little") ^ 1).to_bytes(4, "little")
            break
    rf.write_file(path, frames)
    (w,) = replay(str(edited))
    d = w.difference
    assert d is not None and d.tick == tick and d.message == "TickEvents", d
    assert d.field.startswith("emits[") and ".tokens[" in d.field and d.replayed == d.recorded ^ 1, d.line()


def test_a_torn_last_record_is_left_out(demo_record, tmp_path):
    torn = tmp_path / "torn"
    shutil.copytree(demo_record, torn)
    last = rf.segment_files(str(torn / "worker-0"))[-1][1]
    os.truncate(last, os.path.getsize(last) - 3)
    assert rf.read_file(last).torn_at is not None
    (w,) = replay(str(torn))
    assert w.difference is None and w.epochs[-1].incomplete and w.epochs[-1].ticks > 0


def test_a_record_of_another_abi_version_or_model_is_refused(demo_record, tmp_path, capsys):
    code, _, err = cli(capsys, str(tmp_path / "nothing"))
    assert code == 2 and "no such directory" in err, err
    old = tmp_path / "old-abi"
    shutil.copytree(demo_record, old)
    path = rf.segment_files(str(old / "worker-0"))[1][1]
    frames = [(f.kind, f.body) for f in rf.read_file(path).frames]
    frames[0][1]["abi_version"] -= 1
    rf.write_file(path, frames)
    code, out, err = cli(capsys, str(old), "--json")
    assert code == 2 and f"{path}: abi_version: recorded under ABI v" in err, err
    assert '"refused"' in out
    from superfluid.engine.tiny import write_tiny

    other = write_tiny(tmp_path / "other-model", seed=1)
    code, _, err = cli(capsys, str(demo_record), "--model", str(other))
    assert code == 2 and "model.identity" in err and ".safetensors" in err, err


# --------------------------------------------------------- the fake runtime


def test_a_worker_killed_mid_tick_leaves_a_record_that_replays(tmp_path):
    rec = tmp_path / "rec"
    name = f"rkill{os.getpid()}"
    with daemon(name, *FAKE_WORKER, "--fake-step-cost", "0.3", "--record", str(rec)) as d:
        def kill_in_tick(n: int) -> None:
            if n == 4:
                time.sleep(0.1)  # the worker is in the tick's step (0.3 s) now
                kill_worker(d)

        p = drive(name, greedy(4, 1), after_plan=kill_in_tick)
        assert p.stats.restarts == 1
    results = replay(str(rec))
    assert results[0].difference is None, results[0].difference.line()
    eps = epochs_of(results)
    assert [e["epoch"] for e in eps] == [1, 2], eps
    assert eps[0]["incomplete"] and eps[0]["ticks"] >= 3 and eps[1]["ticks"] > 0, eps
    frames = rf.read_file(rf.segment_files(str(rec / "worker-0"))[0][1]).frames
    assert frames[-1].kind == rf.PLAN  # written before the tick the worker died in


def test_a_bounded_record_drops_its_oldest_files(tmp_path, capsys):
    rec = tmp_path / "rec"
    name = f"rbound{os.getpid()}"
    limit = 32 << 10
    with daemon(name, *FAKE_WORKER, "--record", str(rec), "--record-bytes", str(limit)) as d:
        drive(name, greedy(24, 2, prompt=40, new=40))
        first = rf.segment_files(str(rec / "worker-0"))[0][0]
        assert first > 0, "the bound never dropped a file"
        epoch = d.snapshot()[0]["epoch"]
        kill_worker(d)
        wait_for(lambda: d.snapshot()[0]["epoch"] > epoch and d.snapshot()[0]["state"] == "READY", "a restart")
        drive(name, greedy(2, 3))
    files = rf.segment_files(str(rec / "worker-0"))
    held = sum(os.path.getsize(p) for _, p in files)
    assert held <= limit + (4 << 10), held
    results = replay(str(rec))
    eps = epochs_of(results)
    assert results[0].difference is None and [e["epoch"] for e in eps] == [1, 2], eps
    assert "its start is gone" in eps[0]["skipped"] and eps[1]["ticks"] > 0, eps
    code, out, _ = cli(capsys, str(rec))
    assert code == 0 and "epoch 1 skipped: its start is gone" in out, out
    # Only epoch 1's files: nothing can be replayed, and the first file is named.
    alone = tmp_path / "alone" / "worker-0"
    alone.mkdir(parents=True)
    for _, p in files:
        if rf.read_file(p).frames[0].body["epoch"] == 1:
            shutil.copy(p, alone)
    with pytest.raises(Refused, match=rf"{os.path.basename(files[0][1])}: not replayable: its start is gone"):
        replay(str(alone.parent))


def test_the_files_an_option_names_are_recorded(tmp_path):
    sched = tmp_path / "faults.json"
    sched.write_bytes(b'{"seed": 7}')
    assert rf.option_files(["--fake", "--fault-schedule", str(sched)]) == {"--fault-schedule": b'{"seed": 7}'}
    assert rf.option_files([f"--fault-schedule={sched}"]) == {"--fault-schedule": b'{"seed": 7}'}
    assert rf.option_files(["--model", str(tmp_path)]) == {}


def test_state_directory_answers_are_replayed_without_it(tmp_path):
    """An export, an import of its bytes and an export refused (the file
    exists) replay identical once the state directory is gone: the record
    holds what each call found there."""
    from superfluid.abi import OpStatus, Status
    from superfluid.client import PlanBuilder

    rec, state = tmp_path / "rec", tmp_path / "state"
    name = f"rstate{os.getpid()}"
    prompt = list(range(1, 13))
    with daemon(name, *FAKE_WORKER, "--record", str(rec), "--state-dir", str(state)), \
            Client.connect(name, 0, timeout=120) as c:
        tag = c.new_lane_tag()
        plan = PlanBuilder(0, prefill_token_budget=64).admit(tag, c.write_prompt(prompt)).prefill(tag, 0, 12)
        assert c.tick(plan.decode(tag, 1)).status == Status.OK
        assert c.tick(PlanBuilder(0).retire(tag, publish_to_cache=True)).status == Status.OK
        h = c.op("LEASE_SEED", tokens=prompt, ttl_ticks=1000).handle
        assert c.op("EXPORT_ENTRY", handle=h, path="e.bin").status == OpStatus.OK
        assert c.op("EXPORT_ENTRY", handle=h, path="e.bin").status == OpStatus.BadRequest
        imp = c.op("IMPORT_STATE", tokens=prompt[:8], ttl_ticks=5, path="e.bin")
        assert imp.status == OpStatus.OK, imp
        tag = c.new_lane_tag()
        plan = PlanBuilder(0, prefill_token_budget=64).admit(tag, c.write_prompt(prompt[:8] + [40, 41]),
                                                              seed_handle=imp.handle, determinism_class=1)
        ev = c.tick(plan.prefill(tag, 8, 2).decode(tag, 4))
        assert ev.status == Status.OK, ev.message
    shutil.rmtree(state)
    (w,) = replay(str(rec))
    assert w.difference is None and w.ops >= 4 and w.ticks >= 3, w.difference and w.difference.line()


def test_what_a_hostile_planner_sends_replays_identical(tmp_path):
    """Garbage in plan and op slots, a prompt reference the ring no longer
    holds, a plan the check refuses: every answer replays as it was."""
    import struct

    import msgpack

    from superfluid.abi import MsgKind, Status
    from superfluid.abi.records import RingRef
    from superfluid.client import PlanBuilder

    rec = tmp_path / "rec"
    name = f"rhostile{os.getpid()}"
    rng = random.Random(5)
    with daemon(name, *FAKE_WORKER, "--record", str(rec)), Client.connect(name, 0, timeout=120) as c:
        for kind in (0, MsgKind.PLAN, MsgKind.OP):
            for rb, ab in ((0, 0), (16, 7), (104, 1 << 20), (105, 0)):
                slot = c.seg.plan_queue.reserve(5)
                msg = struct.pack("<IIQQ", kind, rb, ab, c.session) + rng.randbytes(512)
                slot[:len(msg)] = msg
                c.seg.plan_queue.publish()
                assert c.tick(PlanBuilder(0)).status == Status.OK
        for payload in (b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"op": "NOPE", "op_id": 3})):
            c.seg.op_queue.send_bytes(MsgKind.OP, payload, timeout=5, session=c.session)
        stale = RingRef(int(c.write_prompt([1, 2, 3]).ring_id), 7, 0, 3)
        assert c.tick(PlanBuilder(0).admit(c.new_lane_tag(), stale)).status == Status.RejectBadRefGeneration
        assert c.tick(PlanBuilder(0).decode(12345, 4)).status != Status.OK
        drive_one = PlanBuilder(0, prefill_token_budget=64)
        tag = c.new_lane_tag()
        assert c.tick(drive_one.admit(tag, c.write_prompt([5, 6, 7, 8])).prefill(tag, 0, 4).decode(tag, 3)).status \
            == Status.OK
    (w,) = replay(str(rec))
    assert w.difference is None and w.ticks >= 16 and w.ops >= 3, w.difference and w.difference.line()


# ------------------------------------------------ under a fault schedule


def test_a_run_under_a_seeded_fault_schedule_replays_identical(tmp_path):
    """Seeded chance faults, a NaN row at a lane's 4th token, a stall, a
    capacity failure and a fatal error in epoch 1 (the worker exits 70):
    every fault replays, injected marks included, in both epochs; and the
    schedule is the recorded file's content, not whatever the path holds now."""
    import json

    sched = tmp_path / "faults.json"
    sched.write_text(json.dumps({"seed": 11, "rules": [
        {"when": {"chance": 0.15}, "what": {"fault": "INTERNAL"}},
        {"when": {"token": 4}, "what": {"nan": True}, "times": 2},
        {"when": {"tick": 3}, "what": {"stall_ms": 200, "during": "decode"}},
        {"when": {"tick": 4}, "what": {"capacity": "decode"}},
        {"when": {"tick": 6, "epoch": 1}, "what": {"fatal": "decode"}},
    ]}))
    rec = tmp_path / "rec"
    with daemon(f"rfault{os.getpid()}", "--model", str(default_model_dir()), "--record", str(rec),
                "--fault-schedule", str(sched), fault_injection=True) as d:
        p = drive(d.name, greedy(6, 7, new=12))
        exits = d.counters.exits()
    assert p.stats.faults >= 3 and p.stats.restarts == 1 and exits == {(0, "exit_70"): 1}, (p.stats, exits)
    sched.write_text(json.dumps({"rules": []}))  # the replay reads the record, not the file
    results = replay(str(rec))
    assert results[0].difference is None, results[0].difference.line()
    eps = epochs_of(results)
    assert [e["epoch"] for e in eps] == [1, 2] and eps[0]["ticks"] >= 5, eps


def test_a_record_of_another_numeric_class_is_refused_and_another_isa_is_not():
    """A replay must compute what the worker computed: another numeric class
    is named (with how to replay in the recorded one); another ISA of the
    same class changes no bit, so it replays."""
    import dataclasses

    from superfluid.daemon.replay_world import _desc_difference
    from superfluid.engine.runtime import RuntimeDescription

    here = RuntimeDescription("llama-torch", 64, 128, 8, numeric_class="bf16-fma", isa="avx2")
    recorded = dataclasses.asdict(dataclasses.replace(here, numeric_class="bf16-dot", isa="avx512-bf16"))
    diff = _desc_difference(recorded, here)
    assert diff is not None and "runtime.numeric_class: recorded 'bf16-dot', here 'bf16-fma'" in diff
    assert "SUPERFLUID_BF16_CLASS=bf16-dot" in diff
    assert _desc_difference({**recorded, "numeric_class": "bf16-fma"}, here) is None
