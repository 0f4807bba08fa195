"""decode_replay (contract §4): a lane whose prompt tail decode replays is
fed it one token a round, as decode fed it the first time; the tokens are
prompt, not emitted, and counted against the grant."""

from __future__ import annotations

from superfluid.engine.runtime import Feed
from superfluid.executor.tick_state import TickState


def _held_token(token: int | None) -> int:
    assert token is not None  # only lanes holding a token are replayed here
    return token


class ReplayPhase(TickState):
    """The replay part of a Tick's decode (DecodePhase calls it; tick.py holds the rest)."""

    def _replay(self, replaying: list[int], remaining: dict[int, int]) -> None:
        """decode_replay: the prompt's tail, one token a round, as decode fed
        it the first time; not emitted, counted against the grant."""
        ex = self.ex
        self._feed_held(replaying, remaining)
        yield_after = False
        while True:
            passes: list[tuple[int, int, bool]] = []
            for tag in replaying:
                lane = ex.lanes.get(tag)
                if lane is None or remaining.get(tag, 0) <= 0 or len(lane.committed) >= len(lane.prompt):
                    continue
                token = lane.prompt[len(lane.committed)]
                last = len(lane.committed) + 1 == len(lane.prompt)
                lane.committed.append(token)
                remaining[tag] -= 1
                if last and remaining[tag] == 0:
                    lane.pending_input = token
                else:
                    passes.append((tag, token, last))
            if not passes:
                break
            if yield_after and ex.rings.yield_requested():
                for tag, _, _ in passes:
                    ex.lanes[tag].committed.pop()
                    remaining[tag] += 1
                break
            yield_after = True
            for i in range(0, len(passes), max(1, ex.desc.max_batch)):
                chunk = passes[i:i + max(1, ex.desc.max_batch)]
                feeds = [Feed(ex.lanes[tag].seq, [token], last, True) for tag, token, last in chunk]
                got = self.step(feeds, [tag for tag, _, _ in chunk], "a decode replay")
                if got is None:
                    for tag, _, _ in chunk:
                        remaining.pop(tag, None)
                    continue
                it = iter(got)
                for tag, _, last in chunk:
                    if last:
                        self.rows[tag] = next(it)
        for tag in replaying:
            if remaining.get(tag) == 0:
                remaining.pop(tag)

    def _feed_held(self, replaying: list[int], remaining: dict[int, int]) -> None:
        """The token an exact_only prefill held back before a replay: decode
        fed it the first time (the prompt's last), so decode feeds it now,
        before the replayed ones; it is prompt, not grant."""
        ex = self.ex
        held = [tag for tag in replaying if remaining.get(tag, 0) > 0 and ex.lanes[tag].pending_input is not None]
        step = max(1, ex.desc.max_batch)
        for i in range(0, len(held), step):
            chunk = held[i:i + step]
            feeds = [Feed(ex.lanes[tag].seq, [_held_token(ex.lanes[tag].pending_input)], False, True) for tag in chunk]
            if self.step(feeds, chunk, "a decode replay") is None:
                for tag in chunk:
                    remaining.pop(tag, None)
                continue
            for tag in chunk:
                ex.lanes[tag].pending_input = None
