"""The client against a real worker process: describe, prompts, ticks,
tokens, host rows and commits, ops between and inside ticks, partial emits,
and a worker restart seen as one WorkerRestarted from the waits."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest

from superfluid.abi import Finish, OpStatus, PlanFlag, Sampling, Status
from superfluid.client import Client, ClientTimeout, Parallel, PlanBuilder, WorkerRestarted


def test_connect_describe_and_a_tick(fake_worker):
    with fake_worker.connect() as c:
        assert c.epoch == fake_worker.epoch
        d = c.describe()
        assert d["runtime"]["vocab_size"] == 512 and d["worker_epoch"] == c.epoch and d["eos"] == [511]
        assert c.eos_ids() == {511}
        assert d["parallel"] == {"tp": 1, "nnodes": 1} and c.parallel() == Parallel(tp=1, nnodes=1)
        prompt = c.write_prompt([1, 2, 3, 4, 5])
        tag = c.new_lane_tag()
        ev = c.tick(PlanBuilder(0, prefill_token_budget=64).admit(tag, prompt).prefill(tag, 0, 5)
                    .decode(tag, 6))
        assert ev.status == Status.OK and ev.worker_epoch == c.epoch
        (emit,) = ev.emits
        toks = c.tokens(emit)
        assert len(toks) == emit.n_tokens and 1 <= len(toks) <= 6
        assert len(toks) == 6 or emit.finish == Finish.EOS
        # plan_seq is the client's: increasing, stamped on plans that have none
        seq = c.next_plan_seq()
        ev = c.tick(PlanBuilder(0).retire(tag))
        assert ev.plan_seq == seq and ev.status == Status.OK
        # a rejected plan is events with its status, naming the field
        ev = c.tick(PlanBuilder(0).decode(tag, 1))
        assert ev.status == Status.RejectUnknownLane and ev.message.startswith(b"decodes[0]")
        with pytest.raises(ValueError):
            c.submit(PlanBuilder(1))  # below the plan_seqs already sent


def test_host_rows_and_commits(fake_worker):
    with fake_worker.connect() as c:
        tag = c.new_lane_tag()
        prompt = c.write_prompt([7, 8, 9])
        ev = c.tick(PlanBuilder(0, prefill_token_budget=8).admit(tag, prompt, sampling=Sampling.HOST)
                    .prefill(tag, 0, 3).decode(tag, 1))
        (emit,) = ev.emits
        row = c.logits_row(emit)
        assert row.dtype == np.float32 and row.shape == (512,) and emit.n_tokens == 0
        tok = int(np.argmax(row))
        commit = c.commit(emit, tok)
        assert (commit.lane_tag, commit.token_id, commit.logits_nonce) == (tag, tok, emit.logits_nonce)
        ev = c.tick(PlanBuilder(0).commit(*commit).decode(tag, 1))
        assert ev.status == Status.OK and ev.emits[0].logits_nonce not in (0, emit.logits_nonce)
        # the same row again is a stale nonce
        ev = c.tick(PlanBuilder(0).commit(*commit).decode(tag, 1))
        assert ev.status == Status.RejectStaleNonce
        assert c.tick(PlanBuilder(0).retire(tag)).status == Status.OK
        with pytest.raises(ValueError):
            c.commit(ev.emits[0] if ev.emits else emit._replace(logits_nonce=0), 1)


def test_ops_complete_between_and_inside_ticks(fake_worker):
    with fake_worker.connect() as c:
        done = c.op("DESCRIBE")  # idle worker: an OpEvents message
        assert done.status == OpStatus.OK and done.op_id > 0
        bad = c.op("NO_SUCH_OP")
        assert bad.status == OpStatus.UnknownOp
        tag = c.new_lane_tag()
        prompt = c.write_prompt([3, 4])
        first = c.tick(PlanBuilder(0, prefill_token_budget=8).admit(tag, prompt).prefill(tag, 0, 2)
                       .decode(tag, 1))
        # A stopped worker finds the plan and the op both queued when it goes on:
        # it runs the op first, and the completion rides in that plan's events.
        pid = fake_worker.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            seq = c.submit(PlanBuilder(0).decode(tag, 1))
            wake = threading.Timer(0.2, os.kill, (pid, signal.SIGCONT))
            wake.start()
            done = c.op("DESCRIBE", timeout=10)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert done.status == OpStatus.OK
        ev = c.wait_events(10)  # kept for us while op() waited
        assert ev.plan_seq == seq and done.op_id in {oc.op_id for oc in ev.op_completions}
        with pytest.raises(ClientTimeout):
            c.wait_events(0.05)
        c.tick(PlanBuilder(0).retire(tag))
        assert first.status == Status.OK


def test_partial_emits_stream(fake_worker):
    with fake_worker.connect() as c:
        tag = c.new_lane_tag()
        prompt = c.write_prompt([5, 6, 7])
        ev = c.tick(PlanBuilder(0, flags=PlanFlag.PARTIAL_EMITS, prefill_token_budget=8).admit(tag, prompt)
                    .prefill(tag, 0, 3).decode(tag, 5))
        streamed = c.partial_emits()
        assert [p.token_id for p in streamed] == c.tokens(ev.emits[0])
        assert all(p.plan_seq == ev.plan_seq and p.lane_tag == tag for p in streamed)
        assert c.partial_emits() == []
        c.tick(PlanBuilder(0).retire(tag))


def test_a_restart_is_one_exception_then_reconnect(start_worker):
    w = start_worker()
    c = w.connect()
    try:
        old = c.epoch
        tag = c.new_lane_tag()
        prompt = c.write_prompt([1, 2, 3])
        assert c.tick(PlanBuilder(0, prefill_token_budget=8).admit(tag, prompt).prefill(tag, 0, 3)
                      .decode(tag, 2)).status == Status.OK
        new = w.restart()
        assert new == old + 1
        with pytest.raises(WorkerRestarted) as exc:
            c.wait_events(5)
        assert exc.value.epoch == new and exc.value.old_epoch == old
        with pytest.raises(WorkerRestarted):
            c.submit(PlanBuilder(0))  # every call says so until reconnect
        with pytest.raises(WorkerRestarted):
            c.op("DESCRIBE")
        seq = c.next_plan_seq()
        assert c.reconnect(30) == new and c.epoch == new
        assert c.describe()["worker_epoch"] == new
        # the new worker never had the lane; plan_seq goes on from where it was
        ev = c.tick(PlanBuilder(0).decode(tag, 1))
        assert ev.plan_seq == seq and ev.status == Status.RejectUnknownLane and ev.worker_epoch == new
    finally:
        c.close()


def test_a_worker_killed_during_a_wait(start_worker):
    """The wait itself notices: kill -9 while the client is blocked."""
    w = start_worker()
    with w.connect() as c:
        old = c.epoch
        t = threading.Timer(0.3, w.restart)
        t.start()
        try:
            with pytest.raises(WorkerRestarted) as exc:
                c.wait_events(20)
        finally:
            t.join()
        # Noticed at the kill (the epoch may not be bumped yet) or after it.
        assert exc.value.old_epoch == old and exc.value.epoch in (old, old + 1)
        assert c.reconnect(30) == old + 1


def test_a_stale_plan_run_by_the_new_worker_leaves_orphans_to_retire(start_worker):
    """A plan queued for a worker that died before reading it reaches its
    replacement; the lanes it admits are reported as orphans."""
    w = start_worker()
    with w.connect() as c:
        os.kill(w.pid, signal.SIGSTOP)  # alive but not reading: the plan stays queued
        tag = c.new_lane_tag()
        prompt = c.write_prompt([4, 4, 4])
        c.submit(PlanBuilder(0, prefill_token_budget=8).admit(tag, prompt).prefill(tag, 0, 3))
        new = w.restart()
        with pytest.raises(WorkerRestarted):
            c.wait_events(10)
        c.reconnect(30)
        ev = c.tick(PlanBuilder(0))  # the stale plan runs first; its events are not ours
        assert ev.status == Status.OK and ev.worker_epoch == new
        assert c.take_orphans() == {tag} and c.take_orphans() == set()
        assert c.tick(PlanBuilder(0).retire(tag)).status == Status.OK


def test_connect_waits_for_a_ready_worker(start_worker):
    w = start_worker()
    w.kill()
    with pytest.raises(ClientTimeout):
        Client.connect(w.name, 0, timeout=0.2)
    t = threading.Thread(target=w.start)
    t.start()
    try:
        with Client.connect(w.name, 0, timeout=60) as c:
            assert c.epoch == w.seg.epoch
    finally:
        t.join()


def test_one_planner_per_worker(start_worker):
    from superfluid.client import WorkerTaken

    w = start_worker()
    with Client.connect(w.name, 0, timeout=60) as first:
        with pytest.raises(WorkerTaken, match="already has a planner"):
            Client.connect(w.name, 0, timeout=60)
        assert first.tick(PlanBuilder(0)).status == Status.OK  # the first one is undisturbed
    with Client.connect(w.name, 0, timeout=60) as again:  # free once the first closed
        assert again.tick(PlanBuilder(0)).status == Status.OK
