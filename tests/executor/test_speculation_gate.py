"""The speculation gate: drafting goes on where it pays (decode seconds per
emitted token, with and without drafts, over a rolling window), stops where
it does not, and is probed again later. It is fed the seconds it is told, so
every decision here is exact; and a decision only chooses whether drafts are
made, never a token."""

from __future__ import annotations

from superfluid.engine.fake import FakeRuntime
from superfluid.executor import speculation_gate as sg
from superfluid.executor.speculation import StrategyTable
from superfluid.testing.executor import make_executor
from superfluid.testing.speculation import Cycler, Driver, Req, install


def feed(w: sg.GateWindow, n: int, draft_spt: float, plain_spt: float) -> list[bool]:
    """n ticks: decide, then record 10 tokens at the given seconds per token."""
    got = []
    for _ in range(n):
        on = w.decide()
        w.record(on, 10 * (draft_spt if on else plain_spt), 10)
        got.append(on)
    return got


def test_explore_then_keep_drafting_where_it_pays_refreshing_the_plain_figure():
    w = sg.GateWindow()
    got = feed(w, sg.MIN_SAMPLES * 2, draft_spt=1.0, plain_spt=2.0)
    assert got == [True] * sg.MIN_SAMPLES + [False] * sg.MIN_SAMPLES  # each figure measured
    assert w.state == "on"
    got = feed(w, 3 * sg.REFRESH_EVERY, draft_spt=1.0, plain_spt=2.0)
    assert got.count(False) == 3 and w.state == "on"  # one plain tick every REFRESH_EVERY
    f = w.figures()
    assert (f["draft_s_per_token"], f["plain_s_per_token"]) == (1.0, 2.0)
    assert f["draft_samples"] == sg.WINDOW and f["decisions"] == 3 * sg.REFRESH_EVERY + 2 * sg.MIN_SAMPLES


def test_stop_where_drafting_costs_more_and_probe_again_later():
    w = sg.GateWindow()
    feed(w, sg.MIN_SAMPLES * 2, draft_spt=3.0, plain_spt=2.0)
    assert w.state == "off"
    got = feed(w, sg.PROBE_AFTER, draft_spt=3.0, plain_spt=2.0)
    assert not any(got) and w.probes == 0
    # The probe: the old draft figure is dropped and drafting measured afresh; now it pays.
    got = feed(w, sg.MIN_SAMPLES, draft_spt=1.0, plain_spt=2.0)
    assert got == [True] * sg.MIN_SAMPLES and w.probes == 1
    assert w.state == "on" and w.figures()["draft_s_per_token"] == 1.0


def test_the_figures_roll_over_a_window():
    w = sg.GateWindow()
    feed(w, sg.MIN_SAMPLES * 2, draft_spt=1.0, plain_spt=2.0)
    feed(w, sg.WINDOW + 2, draft_spt=1.5, plain_spt=2.0)  # drafting got dearer: new samples push the old out
    f = w.figures()
    assert w.state == "on" and (f["draft_s_per_token"], f["plain_s_per_token"]) == (1.5, 2.0)
    got = feed(w, sg.WINDOW, draft_spt=2.5, plain_spt=2.0)
    # It stops once the window's mean passes MARGIN x plain's: 1.5 + k / WINDOW > 0.9 * 2 at the 5th sample.
    k = next(k for k in range(1, sg.WINDOW + 1) if 1.5 + k / sg.WINDOW > sg.MARGIN * 2.0)
    assert k == 5 and got.index(False) == k and w.state == "off"


def test_buckets_and_strategies_keep_their_own_figures():
    assert [sg.bucket(n) for n in (1, 2, 3, 5, 8, 9, 1000)] == [1, 2, 4, 8, 8, 16, sg.MAX_BUCKET]
    table = StrategyTable()
    a, b = table.install(1, "prompt_lookup", 4, 1, 2), table.install(2, "prompt_lookup", 8, 2, 3)
    gate = sg.SpecGate(table)
    for _ in range(sg.MIN_SAMPLES * 2):
        on = gate.decide(a, 1)
        gate.record(a, 1, on, 1.0 if on else 2.0, 10)  # at B1 drafting pays
        gate.record(a, 2, gate.decide(a, 2), 1.0, 10)  # at B2 a tie: not enough to draft
        on = gate.decide(a, 8)
        gate.record(a, 8, on, 3.0 if on else 2.0, 10)
    gate.record(b, 3, False, 1.0, 0)  # no tokens: nothing recorded
    snap = gate.snapshot()
    assert snap["force"] is None and [s["slot"] for s in snap["strategies"]] == [1, 2]
    buckets = {x["lanes"]: x for x in snap["strategies"][0]["buckets"]}
    assert buckets[1]["state"] == "on" and buckets[2]["state"] == "off" and buckets[8]["state"] == "off"
    assert snap["strategies"][1]["buckets"] == [] and snap["strategies"][1]["acceptance"] is None
    gate.force = False
    assert gate.decide(a, 1) is False


def cost_clock(rt, step_ns: int, token_ns: int):
    """The executor's clock as a cost model: every runtime step and every fed token costs time."""
    return lambda: rt.stats.steps * step_ns + rt.stats.tokens_fed * token_ns


def run(step_ns: int, token_ns: int, *, hits: bool, ticks: int = 40):
    kw = dict(vocab_size=32, max_seq_len=1024, page=16, eos_rate=0.0)
    rt = Cycler(period=5, **kw) if hits else FakeRuntime(**kw)  # the fake's own rows: drafts mostly miss
    ex = make_executor(rt, clock=cost_clock(rt, step_ns, token_ns))
    install(ex, 1, max_draft=8, ngram_min=1, ngram_max=2)
    d = Driver(ex)
    d.admit({1: Req(list(range(5)) * 3, slot=1), 2: Req(list(range(9))[::-1] * 2, slot=1)})
    for _ in range(ticks):
        d.decode({1: (8, 0), 2: (8, 0)})
    return d, ex.registry.spec_gate.snapshot()["strategies"][0]


def test_on_the_executor_the_gate_follows_what_a_step_and_a_token_cost():
    # Steps dominate and the drafts hit: drafting saves steps, the gate keeps it.
    _d, snap = run(step_ns=1_000_000, token_ns=1_000, hits=True)
    (b,) = snap["buckets"]
    assert b["lanes"] == 2 and b["state"] == "on" and b["draft_s_per_token"] < b["plain_s_per_token"]
    assert snap["accepted"] > 0
    # Fed tokens dominate and the drafts miss: it stops.
    d2, snap2 = run(step_ns=1_000, token_ns=1_000_000, hits=False)
    (b2,) = snap2["buckets"]
    assert b2["state"] == "off" and b2["draft_s_per_token"] > b2["plain_s_per_token"]
    late = [s for s in d2.spec[1][-10:]]
    assert all(s == (0, 0, 0) for s in late)  # no drafts while stopped


def test_a_gate_decision_never_changes_a_token():
    outs = []
    for force in (True, False, None):
        rt = Cycler(period=7, vocab_size=32, max_seq_len=512, page=8, eos_rate=0.0)
        ex = make_executor(rt, clock=cost_clock(rt, 1000, 1000))
        install(ex, 1, max_draft=5)
        ex.registry.spec_gate.force = force
        d = Driver(ex)
        d.admit({1: Req([1, 2, 3, 1, 2, 3], sampling=1, base=9, slot=1)})
        for _ in range(12):
            d.decode({1: (5, 0)})
        outs.append((d.out[1], sum(s[0] for s in d.spec[1])))
    assert outs[0][0] == outs[1][0] == outs[2][0]
    assert outs[0][1] > 0 and outs[1][1] == 0
