"""Decode and the events (contract §4): rounds in which every decoding lane
feeds its pending token and picks the next (on the device where the runtime
samples, else on the host), decode_replay's rounds, finishes, HOST rows to
the logits ring, and the TickEvents that report the tick. Drafting lanes'
rounds (a draft verified in the same feed) are speculation_decode.py's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
    CapacityError,
    FatalError,
    Feed,
    LaneFault,
    RuntimeFailure,
    SampleSpec,
    TokenMasks,
)
from superfluid.executor import host_sampling as hs
from superfluid.executor.lanes import Lane, PendingRow
from superfluid.rings.errors import RefError

if TYPE_CHECKING:
    from superfluid.engine.runtime import Runtime
    from superfluid.executor.executor import Executor

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


class DecodePhase:
    """The decode and events phases of a Tick (tick.py holds the rest)."""

    ex: Executor  # (set by Tick)
    rt: Runtime

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
                self.fault(tag, code)
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
            feeds = [Feed(ex.lanes[tag].seq, [ex.lanes[tag].pending_input], False, True) for tag in chunk]
            if self.step(feeds, chunk, "a decode replay") is None:
                for tag in chunk:
                    remaining.pop(tag, None)
                continue
            for tag in chunk:
                ex.lanes[tag].pending_input = None

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
        bad = reg.fill([(self.ex.lanes[tag].grammar, j) for j, tag in enumerate(tags)], bits)
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
        ex, rt = self.ex, self.rt
        desc = ex.desc
        eos = rt.vocabulary().eos
        max_len = desc.max_seq_len
        picked: dict[int, int] = {}
        verified = self.spec_rows  # drafting lanes' rows of this round: tag -> (rows, draft)
        while True:
            # Grammar lanes of this round: those feeding a token, and those with a row to pick from.
            need = [tag for tag, _ in round_ if ex.lanes[tag].grammar is not None]
            need += [tag for tag in self.rows if tag in remaining and tag in ex.lanes
                     and ex.lanes[tag].grammar is not None]
            bits, masks = self._grammar_masks(need, remaining) if need else (None, {})
            if len(masks) < len(need):
                round_ = [(tag, tok) for tag, tok in round_ if tag not in self.faulted_now]
            drafts = self._drafts(round_, remaining) if self.spec_over else None
            for i in range(0, len(round_), max(1, desc.max_batch)):
                chunk = round_[i:i + max(1, desc.max_batch)]
                if drafts and any(tag in drafts for tag, _ in chunk):
                    self._verify_chunk(chunk, drafts, remaining, bits, masks, picked)
                else:
                    self._step_chunk(chunk, bits, masks, remaining, picked)
            round_ = []
            ready = set(self.rows) | set(picked)
            if verified:
                ready.update(verified)
            for tag in sorted(ready):
                lane = ex.lanes.get(tag)
                if lane is None or tag not in remaining:
                    self.rows.pop(tag, None)
                    picked.pop(tag, None)
                    verified.pop(tag, None)
                    continue
                if tag in verified:
                    token = self._take_verified(lane, *verified.pop(tag), remaining, eos, max_len)
                    if token is not None:
                        round_.append((tag, token))
                    continue
                if len(lane.committed) >= max_len:
                    self.rows.pop(tag, None)
                    picked.pop(tag, None)
                    self._finish(lane, Finish.LENGTH, remaining)
                    continue
                if tag in picked:
                    token = int(picked.pop(tag))
                    masks.pop(tag, None)
                else:
                    row = self.rows.pop(tag)
                    if lane.sampling == _HOST:
                        remaining.pop(tag, None)
                        try:
                            ref = ex.rings.write_logits(row)
                        except RefError:
                            self.fault(tag, Fault.REF_SPAN_OOB)
                            continue
                        lane.pending_row = PendingRow(ex.fresh_nonce(), ref)
                        continue
                    j = masks.pop(tag, None)
                    token = self._host_pick(lane, row, None if j is None else bits[j])
                if lane.grammar is not None and not lane.grammar.accept(token):
                    self.fault(tag, _GRAMMAR_OVERFLOW)  # a token its mask should not have allowed
                    remaining.pop(tag, None)
                    continue
                lane.committed.append(token)
                lane.rng_counter += 1
                out = self.out_tokens[tag]
                if self.partial:
                    ex.partial_sink(self.plan.plan_seq, tag, token, len(out))
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
                    round_.append((tag, token))
            if not round_:
                break
            if ex.rings.yield_requested():
                for tag, token in round_:
                    ex.lanes[tag].pending_input = token
                    remaining.pop(tag, None)
                break

    def _step_chunk(self, chunk: list[tuple[int, int]], bits, masks: dict[int, int], remaining: dict[int, int],
                    picked: dict[int, int]) -> None:
        """One step of a round's chunk of one-token feeds: its tokens picked
        on the device where the runtime samples them all, else its rows."""
        ex, rt = self.ex, self.rt
        lanes = [ex.lanes[tag] for tag, _ in chunk]
        feeds = [Feed(ln.seq, [tok], True, True) for ln, (_, tok) in zip(lanes, chunk)]
        tags = [tag for tag, _ in chunk]
        specs = [self._engine_spec(ln) for ln in lanes]
        if all(s is not None for s in specs):
            tm = self._token_masks(bits, masks, tags) if masks else None
            try:
                toks = rt.step_sampled(feeds, specs, tm) if tm is not None else rt.step_sampled(feeds, specs)
            except RuntimeFailure as e:
                self.step_failed(e, tags, "a decode step", remaining)
                return
            if toks is not None:
                picked.update(zip(tags, toks))
                return
        got = self.step(feeds, tags, "a decode step")
        if got is None:
            for tag in tags:
                remaining.pop(tag, None)
            return
        self.rows.update(zip(tags, got))

    def _host_pick(self, lane: Lane, row: np.ndarray, mask: np.ndarray | None = None) -> int:
        ex = self.ex
        exempt = frozenset()
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
