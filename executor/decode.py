"""Decode and the events (contract §4): rounds in which every decoding lane
feeds its pending token and picks the next (on the device where the runtime
samples, else on the host), finishes, HOST rows to the logits ring, and the
TickEvents that report the tick. decode_replay's rounds are replay.py's;
drafting lanes' rounds (a draft verified in the same feed) are
speculation_decode.py's.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from superfluid.abi import Fault, Finish, Sampling, Status, TickStatus
from superfluid.abi.records import (
    LaneEmit,
    LaneLogprob,
    RingRef,
    ShedReport,
    SpecStats,
    TickEvents,
    TickTimings,
)
from superfluid.engine.runtime import (
    NONFINITE,
    CapacityError,
    FatalError,
    Feed,
    LaneFault,
    RuntimeFailure,
    SampleSpec,
    TokenMasks,
    row_finite,
)
from superfluid.executor import host_sampling as hs
from superfluid.executor.faults import INJECTED
from superfluid.executor.lanes import Lane, PendingRow
from superfluid.executor.tick_state import TickState
from superfluid.rings.errors import RefError

_HOST = int(Sampling.HOST)
_OK, _TICK_OK, _TICK_SHED, _TICK_LANE_ERRORS = int(Status.OK), int(TickStatus.OK), int(TickStatus.SHED), \
    int(TickStatus.LANE_ERRORS)
_FINISH_NONE = int(Finish.NONE)
_GRAMMAR_OVERFLOW = int(Fault.GRAMMAR_OVERFLOW)
# TickEvents is built positionally every tick (keywords cost a microsecond); this pins the order.
assert TickEvents._fields == ("struct_size", "plan_seq", "status", "tick_status", "admit_results", "emits", "faults",
                              "shed", "op_completions", "logprobs", "message", "timings", "mem", "worker_epoch")
_GREEDY_SPEC = SampleSpec()


def lane_fault_code(e: RuntimeFailure) -> int | None:
    """The LaneFault code a runtime error becomes; None: it is fatal."""
    if isinstance(e, LaneFault):
        return e.code
    if isinstance(e, CapacityError):
        return int(Fault.OOM_TENTATIVE)
    if isinstance(e, FatalError):
        return None
    return int(Fault.INTERNAL)  # Unsupported, UnknownSequence, OutOfBounds: ours, but a lane's


def lane_fault(e: RuntimeFailure) -> int:
    """lane_fault_code of an error the caller knows is not a FatalError (caught before it)."""
    code = lane_fault_code(e)
    assert code is not None
    return code


@dataclasses.dataclass(slots=True, eq=False)
class DecodeRound:
    """What a decode round keeps by lane tag besides the tick's rows
    (Tick.rows, Tick.spec_rows): the grant each lane has left (for the
    tick), the tokens the engine sampled, and the grammar lanes' rows in the
    round's bitmask."""

    remaining: dict[int, int]
    picked: dict[int, int] = dataclasses.field(default_factory=dict)
    bits: np.ndarray | None = None
    masks: dict[int, int] = dataclasses.field(default_factory=dict)

    def mask_rows(self) -> np.ndarray:
        """The bitmask, there whenever masks is not empty."""
        assert self.bits is not None
        return self.bits


class DecodePhase(TickState):
    """The decode and events phases of a Tick (tick.py holds the rest)."""

    # ----------------------------------------------------------- decode

    @staticmethod
    def _engine_spec(lane: Lane) -> SampleSpec | None:
        """The device sampling spec of a lane, or None when the host samples it."""
        if not lane.engine_ok:
            return None
        p = lane.params
        if lane.greedy:
            return _GREEDY_SPEC
        return SampleSpec(p.temperature, p.top_k, p.top_p, p.min_p, lane.position)

    def decode(self) -> None:
        ex, plan = self.ex, self.plan
        yielded = self.yielded
        remaining: dict[int, int] = {}
        replaying: list[int] = []
        round_: list[tuple[int, int]] = []  # (tag, token to feed)
        for d in plan.decodes:
            tag = d.lane_tag
            if tag in self.faulted_now:
                continue
            code = ex.lanes.injected.pop(tag, None)
            if code is not None:
                self.fault(tag, code, INJECTED)
                ex._fault_fired("lane_fault")
                continue
            if d.max_new_tokens == 0:
                continue
            lane = ex.lanes[tag]
            if yielded and len(lane.committed) < len(lane.prompt):
                continue  # its prefill was cut short by the yield
            remaining[tag] = d.max_new_tokens
            if len(lane.committed) < len(lane.prompt):
                replaying.append(tag)
                continue
            if tag in self.rows:
                continue  # the prefill's last step gave its first row
            if lane.pending_input is None:
                raise ex.fatal("decode", RuntimeError(f"lane {tag} has no input to decode"))
            round_.append((tag, lane.pending_input))
            lane.pending_input = None
        self._replay(replaying, remaining)
        if not ex.registry.strategies.slots:
            self._rounds(round_, remaining)
            return
        t0 = ex.clock()
        self._spec_begin(remaining)
        self._rounds(round_, remaining)
        self._spec_end((ex.clock() - t0) / 1e9, bool(replaying))

    def _finish(self, lane: Lane, code: int, remaining: dict[int, int]) -> None:
        self.finishes[lane.tag] = int(code)
        lane.finished = True
        remaining.pop(lane.tag, None)

    def _grammar_masks(self, tags: list[int], remaining: dict[int, int]) -> tuple[np.ndarray, dict[int, int]]:
        """The next-token masks of these grammar lanes, all in one fill call
        (contract §5: the mask comes first): the bitmask, row j for tags[j],
        and each lane's row; a lane whose matcher is in error faults
        GRAMMAR_OVERFLOW (and has no row), the others go on."""
        reg = self.ex.registry.grammars
        bits = reg.bitmask(len(tags), fill=False)  # fill writes every row
        bad = reg.fill([(self.ex.lanes[tag].matcher(), j) for j, tag in enumerate(tags)], bits)
        for j in bad:
            self.fault(tags[j], _GRAMMAR_OVERFLOW)
            remaining.pop(tags[j], None)
        return bits, {tag: j for j, tag in enumerate(tags) if tag not in self.faulted_now}

    @staticmethod
    def _token_masks(bits: np.ndarray, where: dict[int, int], tags: list[int]) -> TokenMasks | None:
        """The TokenMasks of a step's feeds (tags) out of the round's bitmask:
        its rows as they are (a view, no copy) when the chunk's masked feeds
        are a run of consecutive bitmask rows, as when every lane of a round
        has a grammar; else the rows gathered."""
        masked = [k for k, tag in enumerate(tags) if tag in where]
        if not masked:
            return None
        first = where[tags[masked[0]]]
        if all(where[tags[k]] == first + i for i, k in enumerate(masked)):
            sub = bits[first:first + len(masked)]
        else:
            sub = bits[[where[tags[k]] for k in masked]]
        return TokenMasks(sub, None if len(masked) == len(tags) else masked)

    def _rounds(self, round_: list[tuple[int, int]], remaining: dict[int, int]) -> None:
        """Decode rounds until no lane feeds another token (or a yield is asked
        for): each round masks, feeds, then takes each lane's token."""
        ex = self.ex
        eos = self.rt.vocabulary().eos
        max_len = ex.desc.max_seq_len
        r = DecodeRound(remaining)
        while True:
            round_ = self._round_masks(round_, r)
            self._feed_round(round_, r)
            round_ = self._take_round(r, eos, max_len)
            if not round_:
                break
            if ex.rings.yield_requested():
                for tag, token in round_:
                    ex.lanes[tag].pending_input = token
                    remaining.pop(tag, None)
                break

    def _round_masks(self, round_: list[tuple[int, int]], r: DecodeRound) -> list[tuple[int, int]]:
        """The masks of this round's grammar lanes (those feeding a token, and
        those with a row to pick from) into r; the round less lanes that faulted."""
        lanes = self.ex.lanes
        need = [tag for tag, _ in round_ if lanes[tag].grammar is not None]
        need += [tag for tag in self.rows if tag in r.remaining and tag in lanes and lanes[tag].grammar is not None]
        r.bits, r.masks = self._grammar_masks(need, r.remaining) if need else (None, {})
        if len(r.masks) < len(need):
            round_ = [(tag, tok) for tag, tok in round_ if tag not in self.faulted_now]
        return round_

    def _feed_round(self, round_: list[tuple[int, int]], r: DecodeRound) -> None:
        """Step the round's feeds, max_batch at a time; drafting lanes' with their drafts."""
        step = max(1, self.ex.desc.max_batch)
        drafts = self._drafts(round_, r.remaining) if self.spec_over else None
        for i in range(0, len(round_), step):
            chunk = round_[i:i + step]
            if drafts and any(tag in drafts for tag, _ in chunk):
                self._verify_chunk(chunk, drafts, r)
            else:
                self._step_chunk(chunk, r)

    def _take_round(self, r: DecodeRound, eos: frozenset[int], max_len: int) -> list[tuple[int, int]]:
        """Each lane with a sampled token, a row or verified rows takes its
        token(s); the next round: the lanes that feed one, with it."""
        rows, picked, verified = self.rows, r.picked, self.spec_rows  # drafting lanes': tag -> (rows, draft)
        ready = set(rows) | set(picked)
        if verified:
            ready.update(verified)
        lanes = self.ex.lanes
        next_round: list[tuple[int, int]] = []
        for tag in sorted(ready):
            lane = lanes.get(tag)
            if lane is None or tag not in r.remaining:
                rows.pop(tag, None)
                picked.pop(tag, None)
                verified.pop(tag, None)
                continue
            if tag in verified:
                token = self._take_verified(lane, *verified.pop(tag), r.remaining, eos, max_len)
            else:
                token = self._take(lane, r, eos, max_len)
            if token is not None:
                next_round.append((tag, token))
        return next_round

    def _take(self, lane: Lane, r: DecodeRound, eos: frozenset[int], max_len: int) -> int | None:
        """The lane's token of this round: sampled on the device, else picked
        from its row on the host (a HOST lane's row goes to the logits ring
        instead); committed. The token it feeds next round, or None."""
        ex, tag, remaining = self.ex, lane.tag, r.remaining
        if len(lane.committed) >= max_len:
            self.rows.pop(tag, None)
            r.picked.pop(tag, None)
            self._finish(lane, Finish.LENGTH, remaining)
            return None
        row = None
        if tag in r.picked:
            token = int(r.picked.pop(tag))
            r.masks.pop(tag, None)
            if token == NONFINITE:
                self.numeric_fault(lane, remaining)
                return None
        else:
            row = self.rows.pop(tag)
            if not row_finite(row):  # no token, nor a HOST row, from garbage
                r.masks.pop(tag, None)
                self.numeric_fault(lane, remaining)
                return None
        if ex.faults is not None and ex.faults.tokens and self.token_rules(lane, remaining):
            r.masks.pop(tag, None)
            return None
        if row is not None:
            if lane.sampling == _HOST:
                remaining.pop(tag, None)
                try:
                    ref = ex.rings.write_logits(row)
                except RefError:
                    self.fault(tag, Fault.REF_SPAN_OOB)
                    return None
                lane.pending_row = PendingRow(ex.fresh_nonce(), ref)
                return None
            j = r.masks.pop(tag, None)
            token = self._host_pick(lane, row, None if j is None else r.mask_rows()[j])
        if lane.grammar is not None and not lane.grammar.accept(token):
            self.fault(tag, _GRAMMAR_OVERFLOW)  # a token its mask should not have allowed
            remaining.pop(tag, None)
            return None
        lane.committed.append(token)
        lane.rng_counter += 1
        if ex.faults is not None and ex.faults.tokens and ex.fault_rt is not None:
            ex.faults.arm_nan(ex, lane, ex.fault_rt)
        out = self.out_tokens[tag]
        if self.partial:
            sink = ex.partial_sink
            assert sink is not None  # self.partial says there is one
            sink(self.plan.plan_seq, tag, token, len(out))
        out.append(token)
        remaining[tag] -= 1
        lane.pending_input = token
        if token in eos and not lane.ignore_eos:
            self._finish(lane, Finish.EOS, remaining)
        elif lane.grammar is not None and lane.grammar.is_complete():
            self._finish(lane, Finish.GRAMMAR, remaining)
        elif len(lane.committed) >= max_len:
            self._finish(lane, Finish.LENGTH, remaining)
        elif remaining[tag] == 0:
            remaining.pop(tag)
        else:
            lane.pending_input = None
            return token
        return None

    def _step_chunk(self, chunk: list[tuple[int, int]], r: DecodeRound) -> None:
        """One step of a round's chunk of one-token feeds: its tokens picked
        on the device where the runtime samples them all, else its rows."""
        ex, rt = self.ex, self.rt
        lanes = [ex.lanes[tag] for tag, _ in chunk]
        feeds = [Feed(ln.seq, [tok], True, True) for ln, (_, tok) in zip(lanes, chunk)]
        tags = [tag for tag, _ in chunk]
        specs = [s for s in (self._engine_spec(ln) for ln in lanes) if s is not None]
        if len(specs) == len(lanes):
            tm = self._token_masks(r.mask_rows(), r.masks, tags) if r.masks else None
            try:
                toks = rt.step_sampled(feeds, specs, tm) if tm is not None else rt.step_sampled(feeds, specs)
            except RuntimeFailure as e:
                self.step_failed(e, tags, "a decode step", r.remaining)
                return
            if toks is not None:
                r.picked.update(zip(tags, toks))
                return
        got = self.step(feeds, tags, "a decode step")
        if got is None:
            for tag in tags:
                r.remaining.pop(tag, None)
            return
        self.rows.update(zip(tags, got))

    def _host_pick(self, lane: Lane, row: np.ndarray, mask: np.ndarray | None = None) -> int:
        ex = self.ex
        exempt: frozenset[int] = frozenset()
        if hs.penalizes(lane.params):
            if ex.registry.penalty_exempt is None:
                v = self.rt.vocabulary()
                ex.registry.penalty_exempt = frozenset(v.specials.values()) | frozenset(v.eos)
            exempt = ex.registry.penalty_exempt
        want = 0 if lane.logprobs_top is None else lane.logprobs_top + 1
        token, lp = hs.pick(row, lane.sampling, lane.params, lane.position, bias=lane.bias, history=lane.committed,
                            exempt=exempt, mask=mask, want_logprobs=want)
        if lp is not None:
            idx = len(self.out_tokens[lane.tag])
            self.logprobs.append(LaneLogprob(lane_tag=lane.tag, token_id=token, logprob=lp.logprob,
                                             n_top=len(lp.top_ids), index=idx, top_ids=lp.top_ids,
                                             top_logprobs=lp.top_logprobs))
        return token

    # ----------------------------------------------------------- events

    def events(self, timings: TickTimings) -> TickEvents:
        ex = self.ex
        emits = []
        for d in self.plan.decodes:
            tag = d.lane_tag
            if tag in self.faulted_now or tag not in ex.lanes:
                continue
            lane = ex.lanes[tag]
            finish = self.finishes.get(tag, _FINISH_NONE)
            if lane.sampling == _HOST:
                row = lane.pending_row
                emits.append(LaneEmit(lane_tag=tag, finish=finish, logits_row=row.ref if row else RingRef(),
                                      logits_nonce=row.nonce if row else 0))
                continue
            tokens = self.out_tokens.get(tag, [])
            try:
                ref = ex.rings.write_tokens(np.asarray(tokens, dtype=np.uint32))
            except RefError:
                self.fault(tag, Fault.REF_SPAN_OOB)
                continue
            ex.counters.tokens_emitted += len(tokens)
            spec = self.spec_stats.get(tag) if self.spec_stats else None
            if spec is None:
                emits.append(LaneEmit(lane_tag=tag, token_ref=ref, n_tokens=len(tokens), finish=finish))
            else:
                emits.append(LaneEmit(lane_tag=tag, token_ref=ref, n_tokens=len(tokens), finish=finish,
                                      spec=SpecStats(*spec)))
        status = (_TICK_LANE_ERRORS if self.faults else
                  _TICK_SHED if self.chunks_dropped or self.evictions else _TICK_OK)
        shed = ShedReport(self.chunks_dropped, self.evictions, self.bytes_evicted, tuple(self.shed))
        comps = ex.pending.completions
        if comps:
            ex.pending.completions = []
        return TickEvents(0, self.plan.plan_seq, _OK, status, tuple(self.admit_results), tuple(emits),
                          tuple(self.faults), shed, tuple(comps), tuple(self.logprobs), b"", timings, ex._mem_record(),
                          ex.epoch)
