"""On an exact_only (recurrent) runtime a position fed by a decode feed and
one fed by a prefill hold different state (Feed.decode), and the fake runtime
hashes them apart. So the executor must feed every position the same way on
every path: the prompt's last token always by decode (a first run, a replay
after a restart, a one-token prompt decoded now or later), and a published
entry settled (Runtime.seq_settle) before a lane continues from it, and a
seed that would cover a token decode feeds refused."""

from __future__ import annotations

import pytest

from superfluid.abi import OpStatus, Status
from superfluid.client.builder import sampling_params
from superfluid.testing.executor import SAMPLE, emit_of, emitted, put
from superfluid.testing.invariants import assert_reject
from superfluid.testing.seeds import SPI, exe

PROMPT = [i % 50 + 1 for i in range(40)]
N = 8


def _tokens(d, prompt, **kw) -> list[int]:
    tag, r = d.admit(prompt, n=N, **kw)
    assert r.ok, r.message
    return emitted(d.ex, emit_of(r, tag))


def _exact(**kw):
    return exe(exact_only=True, max_seq_len=256, **kw)


def test_a_replay_feeds_the_prompts_last_token_as_decode_did():
    want = _tokens(_exact(), PROMPT)
    k = 3
    d = _exact()
    d.tag += 1
    b = d.plan()
    again = PROMPT + want[:k]  # re-admitted after a restart: the generated ones replayed
    b.admit(d.tag, put(d.ex, again), params=sampling_params(temperature=0.9, top_k=20), rng_counter_base=100 + k,
            decode_replay=k, sampling=SAMPLE)
    b.prefill(d.tag, 0, len(PROMPT)).decode(d.tag, N)  # k replayed, N - k new
    r = d.ex.tick(b.build())
    assert r.ok, r.message
    assert emitted(d.ex, emit_of(r, d.tag)) == want[k:]
    # Control: the same lane with its whole history prefilled (no replay) differs.
    d2 = _exact()
    d2.tag += 1
    b = d2.plan().admit(d2.tag, put(d2.ex, again), params=sampling_params(temperature=0.9, top_k=20),
                        rng_counter_base=100 + k, sampling=SAMPLE).prefill(d2.tag, 0, len(again)).decode(d2.tag, N - k)
    r = d2.ex.tick(b.build())
    assert r.ok and emitted(d2.ex, emit_of(r, d2.tag)) != want[k:]


def test_a_one_token_prompt_is_decoded_the_same_now_or_later():
    now = _tokens(_exact(), [7])
    d = _exact()
    tag, r = d.admit([7], n=0)  # prefill only: the token is held back for decode
    assert r.ok and d.ex.lanes[tag].pending_input == 7 and d.ex.runtime.seq_len(d.ex.lanes[tag].seq) == 0
    r = d.ex.tick(d.plan().decode(tag, N).build())
    assert r.ok and emitted(d.ex, emit_of(r, tag)) == now


@pytest.mark.parametrize("settle", [True, False])
def test_a_lane_seeded_from_a_published_lane_decodes_as_a_fresh_one(settle, monkeypatch):
    d = _exact()
    first = d.serve(PROMPT, n=N)  # published: PROMPT + first, its tail fed by decode
    turn = PROMPT + first + [9]  # the next turn adds one token: it decodes at once from the seed
    want = _tokens(_exact(), turn)
    if not settle:  # the control: an entry left as decode fed it
        monkeypatch.setattr(type(d.ex.runtime), "seq_settle", lambda self, seq: None)
        d = _exact()
        d.serve(PROMPT, n=N)
    h = d.lease(turn)
    assert h.status == int(OpStatus.OK) and h.value == len(turn) - 1
    got = _tokens(d, turn, seed=h.handle, value=h.value)
    assert (got == want) == settle


def _readmit(d, again, k, *, seed: int = 0, value: int = 0):
    """`again` re-admitted with its last k tokens replayed (a restart's way)."""
    d.tag += 1
    b = d.plan().admit(d.tag, put(d.ex, again), params=sampling_params(temperature=0.9, top_k=20),
                       rng_counter_base=100 + k, decode_replay=k, sampling=SAMPLE, seed_handle=seed,
                       determinism_class=SPI)
    if value < len(again) - k:
        b.prefill(d.tag, value, len(again) - k - value)
    return b.decode(d.tag, N)


def test_a_seed_reaching_what_a_replay_decodes_is_refused_and_one_short_of_it_is_not():
    # A request whose prompt was published whole is re-admitted after a restart with k of
    # its tokens replayed: its first run fed prompt[-1] (held back) and the k by decode.
    d = _exact()
    first = d.serve(PROMPT, n=N)
    turn = PROMPT + first  # the entry's key: its state is a prefill of all of it
    want = _tokens(_exact(), turn)
    k = 3
    again = turn + want[:k]
    h = d.lease(turn)
    assert h.status == int(OpStatus.OK) and h.value == len(turn)
    r = assert_reject(d.ex, _readmit(d, again, k, seed=h.handle, value=h.value).build(),
                      Status.RejectIllegalCombination, "admits[0].seed_handle")
    assert f"lease at most {len(turn) - 1} tokens" in r.message
    r = d.ex.tick(_readmit(d, again, k).build())  # the same admission unseeded
    assert r.ok and emitted(d.ex, emit_of(r, d.tag)) == want[k:]
    # One short of prefill's end (an entry the next turn's prompt extends): the tokens are the same.
    d2 = _exact()
    d2.serve(PROMPT, n=N)
    longer = turn + [9]
    want2 = _tokens(_exact(), longer)
    h = d2.lease(longer)
    assert h.status == int(OpStatus.OK) and h.value == len(turn) == len(longer) - 1
    r = d2.ex.tick(_readmit(d2, longer + want2[:k], k, seed=h.handle, value=h.value).build())
    assert r.ok, r.message
    assert emitted(d2.ex, emit_of(r, d2.tag)) == want2[k:]
