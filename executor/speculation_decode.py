"""Drafting lanes in decode rounds (contract §4): draft, verify, accept, cut back.

A drafting lane's round feeds its pending token and a draft as one feed
through step_rows (batched with the round's other feeds where the runtime
says verify_batches, else one drafting feed a call) and gets a row for every
token fed. Row i is picked exactly as a plain round would pick it: the host
sampler at the lane's next rng position, penalties over the history so far.
The lane takes drafts while the picked token equals the draft token; the
first mismatch (or the row after the whole draft) is its next token, and its
sequence is cut back to what it kept. Since every runtime's rows are
batch- and chunk-invariant (superfluid/testing/conformance.py holds each runtime
to it bitwise) and the engine's sampler equals the host's, these are the
tokens plain rounds would pick: a drafting lane keeps SEED_PATH_INVARIANT.

The grant: max_new_tokens counts every token as a plain round would; a
verified draft may run `overshoot` tokens past it (never a plain round).
Draft length k = min(depth, grant left + overshoot left - 1, room to
max_seq_len - 1, what spare cells allow). Spare cells are the pool's free
cells less every lane's cells still promised by the memory check, so a draft
never takes a cell the plan was promised; a verification the pool refuses
anyway (CapacityError) is run again without drafts, so a draft never faults
a lane and never makes a plan NeedsReplan.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from superfluid.abi import Finish, Sampling
from superfluid.engine.fault_runtime import InjectedCapacity
from superfluid.engine.runtime import CapacityError, FatalError, Feed, RuntimeFailure, row_finite
from superfluid.executor.decode import lane_fault
from superfluid.executor.tick_state import TickState

if TYPE_CHECKING:
    from superfluid.executor.decode import DecodeRound
    from superfluid.executor.lanes import Lane

_HOST = int(Sampling.HOST)


class SpecPhase(TickState):
    """The drafting part of a Tick's decode (DecodePhase calls it; tick.py holds the rest)."""

    # ------------------------------------------------------- per tick

    def _spec_begin(self, remaining: dict[int, int]) -> None:
        """The gate's decision for each strategy decoding this tick; which lanes draft."""
        ex = self.ex
        lanes = ex.lanes
        live = [lanes[tag] for tag in remaining if tag in lanes]
        specs = [(ln.tag, ln.spec) for ln in live if ln.spec is not None]
        if not specs:
            return
        self.spec_lanes = sum(1 for ln in live if ln.sampling != _HOST)
        overshoot = {d.lane_tag: d.overshoot for d in self.plan.decodes}
        decisions = self.spec_decisions
        for tag, ls in specs:
            st = ls.strategy
            on = decisions.get(st)
            if on is None:
                on = decisions[st] = ex.registry.spec_gate.decide(st, self.spec_lanes)
            if on:
                self.spec_over[tag] = overshoot[tag]
            self.spec_stats[tag] = [0, 0, st.cert_id if on else 0]
        # Tokens sampled from rows decode did not step for (a prefill's last row) cost no decode time.
        self.spec_free_rows = sum(1 for ln in live if ln.tag in self.rows and ln.sampling != _HOST)

    def _spec_end(self, seconds: float, replayed: bool) -> None:
        """Record the tick's decode against each strategy's decision: only a
        tick without replays whose rounds emitted a token or more per lane."""
        if not self.spec_decisions or replayed:
            return
        tokens = sum(len(t) for t in self.out_tokens.values()) - self.spec_free_rows
        if tokens < self.spec_lanes:
            return
        for st, on in self.spec_decisions.items():
            self.ex.registry.spec_gate.record(st, self.spec_lanes, on, seconds, tokens)

    # ------------------------------------------------------- per round

    def _spare_pages(self) -> int | None:
        """Pool pages no lane was promised this tick; None: no cell limit."""
        ex, rt = self.ex, self.rt
        mem = rt.mem_counters()
        if not mem.cells_total:
            return None
        page = ex.page
        promised = 0
        for tag, after in self.cells_after.items():
            lane = ex.lanes.get(tag)
            if lane is not None:
                promised += max(0, -(-after // page) - -(-rt.seq_len(lane.seq) // page))
        return max(0, (mem.cells_total - mem.cells_used) // page - promised)

    def _drafts(self, round_: list[tuple[int, int]], remaining: dict[int, int]) -> dict[int, list[int]]:
        """This round's drafts by lane (drafting lanes with a proposal only)."""
        ex = self.ex
        over = self.spec_over
        faults = ex.faults if ex.faults is not None and ex.faults.tokens else None
        # A lane a token rule watches decodes plainly: its rule fires at one token, not within a draft.
        todo = [tag for tag, _ in round_ if tag in over and (faults is None or not faults.watches(tag))]
        if not todo:
            return {}
        max_len, page = ex.desc.max_seq_len, ex.page
        spare = self._spare_pages()
        out: dict[int, list[int]] = {}
        for tag in todo:
            lane = ex.lanes[tag]
            drafter = lane.drafter()
            held = len(lane.committed) - 1  # cells before this round's feed (its token is the pending one)
            k = min(drafter.depth, remaining[tag] + over[tag] - 1, max_len - held - 2)
            if spare is not None:
                # Past the cells promised to it, a lane's feed may take only spare pages.
                own = -(-max(self.cells_after.get(tag, 0), held) // page)
                k = min(k, (own + spare) * page - held - 1)
            if k <= 0:
                continue
            d = drafter.propose(lane.committed, k)
            if not d:
                continue
            if spare is not None:
                spare -= max(0, -(-(held + 1 + len(d)) // page) - own)
            out[tag] = d
        return out

    def _verify_chunk(self, chunk: list[tuple[int, int]], drafts: dict[int, list[int]], r: DecodeRound) -> None:
        """Step a chunk of which some feeds carry drafts."""
        if self.ex.desc.verify_batches:
            self._verify_step(chunk, drafts, r)
            return
        rest = [c for c in chunk if c[0] not in drafts]
        for c in chunk:
            if c[0] in drafts:
                self._verify_step([c], drafts, r)
        if rest:
            self._step_chunk(rest, r)

    def _verify_step(self, chunk: list[tuple[int, int]], drafts: dict[int, list[int]], r: DecodeRound) -> None:
        ex = self.ex
        tags = [tag for tag, _ in chunk]
        feeds = [Feed(ex.lanes[tag].seq, [tok, *drafts.get(tag, ())], True) for tag, tok in chunk]
        try:
            got = self.rt.step_rows(feeds)
        except InjectedCapacity as e:  # a fault schedule's: the lanes fault as on a plain step
            self.step_failed(e, tags, "a draft verification", r.remaining)
            return
        except CapacityError:
            # The pool had less room than counted (a copy-on-write, say): the same
            # round without drafts, which the memory check made room for.
            for tag in tags:
                drafts.pop(tag, None)
            self._step_chunk(chunk, r)
            return
        except RuntimeFailure as e:
            self.step_failed(e, tags, "a draft verification", r.remaining)
            return
        if got is None or len(got) != len(feeds) or any(len(r) != len(f.tokens) for r, f in zip(got, feeds)):
            raise ex.fatal("a draft verification", RuntimeError("step_rows did not return a row per fed token"))
        for tag, rows in zip(tags, got):
            d = drafts.get(tag)
            if d:
                self.spec_rows[tag] = (rows, d)
            else:
                self.rows[tag] = rows[-1]

    def _verify_pick(self, lane: Lane, row: np.ndarray) -> int:
        """A verified row's token: the plain round's pick (tests replace this to show it matters)."""
        return self._host_pick(lane, row)

    def _take_verified(self, lane: Lane, rows: np.ndarray, draft: list[int], remaining: dict[int, int],
                       eos: frozenset[int],
                       max_len: int) -> int | None:
        """Pick a verified feed's rows, take what matches, cut the sequence
        back; the token the lane feeds next round, or None when it is done."""
        ex, tag = self.ex, lane.tag
        over = self.spec_over
        out = self.out_tokens[tag]
        start = len(lane.committed)  # the sequence held start - 1 cells before the feed
        taken = accepted = 0
        finish = None
        token = None
        for i in range(len(draft) + 1):
            if len(lane.committed) >= max_len:
                finish = Finish.LENGTH
                break
            if remaining[tag] > 0:
                remaining[tag] -= 1
            elif over[tag] > 0:
                over[tag] -= 1
            else:
                break
            if not row_finite(rows[i]):
                self.numeric_fault(lane, remaining)
                return None
            token = self._verify_pick(lane, rows[i])
            lane.committed.append(token)
            lane.rng_counter += 1
            if self.partial:
                sink = ex.partial_sink
                assert sink is not None  # self.partial says there is one
                sink(self.plan.plan_seq, tag, token, len(out))
            out.append(token)
            taken += 1
            if token in eos and not lane.ignore_eos:
                finish = Finish.EOS
                break
            if len(lane.committed) >= max_len:
                finish = Finish.LENGTH
                break
            if i == len(draft) or token != draft[i]:
                break
            accepted += 1
        stats = self.spec_stats[tag]
        stats[0] += len(draft)
        stats[1] += accepted
        lane.drafter().verified(len(draft), accepted)
        # Keep the pending token's cell and the taken drafts; the last taken token is pending.
        keep = start - 1 + max(taken, 1)
        if keep < start + len(draft):
            try:
                self.rt.seq_truncate(lane.seq, keep)
            except FatalError as e:
                raise ex.fatal("cutting a draft back", e) from e
            except RuntimeFailure as e:
                self.fault(tag, lane_fault(e))
                remaining.pop(tag, None)
                return None
        lane.pending_input = token if taken else None
        if finish is not None:
            self._finish(lane, finish, remaining)
            return None
        if remaining[tag] == 0:
            remaining.pop(tag)
            return None
        lane.pending_input = None
        return token
