"""superfluid.testing.harness: the README's test for harness authors, as it
is printed there (a worker killed at a lane's 5th token; the request still
finishes with the uninterrupted tokens), and the fixture form."""

from __future__ import annotations

import pytest

from superfluid.testing.harness import faulty_daemon


# README.md, "For harness authors": keep the two in step.
def test_a_kill_at_the_fifth_token_changes_no_token():
    prompt = list(range(10, 40))
    with faulty_daemon() as h:  # uninterrupted
        rid = h.planner.submit(prompt, 12)
        want = h.planner.run_until_done(120).results[rid].tokens
    kill = {"rules": [{"when": {"token": 5, "epoch": 1}, "what": {"fatal": "now"}}]}
    with faulty_daemon(schedule=kill) as h:  # the first worker dies at a lane's 5th token
        rid = h.planner.submit(prompt, 12)
        got = h.planner.run_until_done(120).results[rid].tokens
        assert h.exits() == {(0, "exit_70"): 1} and h.planner.stats.restarts == 1
    assert got == want and len(want) == 12


def test_the_fixture_a_record_and_a_bad_schedule(faulty_daemon_factory, tmp_path):
    h = faulty_daemon_factory(tick_timeout=0, record=tmp_path / "rec")
    assert h.install_faults([{"when": {"token": 2}, "what": {"fault": "INTERNAL"}}]) == 1
    rid = h.planner.submit([5, 6, 7], 4)
    rep = h.planner.run_until_done(120)
    assert h.planner.stats.faults == 1 and len(rep.results[rid].tokens) == 4  # faulted, re-admitted, done
    from superfluid.daemon.replay import replay

    (w,) = replay(str(tmp_path / "rec"))  # the installed schedule's fault included
    assert w.difference is None and w.ticks >= 2
    with pytest.raises(ValueError, match=r"rules\[0\]\.when\.tick"):
        h.install_faults([{"when": {"tick": 0}, "what": {"fault": 2}}])
    no_what = {"rules": [{"when": {"tick": 1}}]}
    with pytest.raises(ValueError, match=r"rules\[0\]\.what"), faulty_daemon(schedule=no_what):
        pass
