"""Prompt-lookup speculation (contract §4, §7 INSTALL_STRATEGY): the strategies a
planner installs, which lanes draft, and the n-gram drafter.

A strategy sits in a slot (1..MAX_SLOTS) with a cert_id of its own; installing
a slot again replaces it under a new cert_id, and lanes admitted earlier keep
the strategy they got. A lane admitted with a slot drafts when nothing it
carries changes a row in a way verification does not replay: not HOST, no
grammar, no logit bias, no logprobs (`drafts`). Such a lane gets the
strategy's cert_id in its AdmitResult; one that cannot draft gets cert_id 0.

The drafter is a pure function of the lane's committed tokens (prompt and
generated): the longest suffix n-gram (ngram_max down to ngram_min) that
occurred earlier proposes the tokens that followed its most recent earlier
occurrence, copied on into the draft itself where they run out (so a cycle
shorter than the draft proposes itself again). LaneSpec keeps an index of
every n-gram's latest start, grown by the tokens committed since its last
draft, so a draft costs O(new tokens), not O(history). Verification and
acceptance are decode's (speculation_decode.py); the keep/stop gate is speculation_gate.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, TypedDict

from superfluid.abi import Sampling

if TYPE_CHECKING:
    from superfluid.engine.runtime import Runtime
    from superfluid.executor.speculation_gate import GateWindow

KINDS = ("prompt_lookup",)
MAX_SLOTS = 8  # slots 1..MAX_SLOTS (the metrics block keeps one row of figures per slot)
MAX_DRAFT = 64  # tokens a draft may propose: max_draft is 1..MAX_DRAFT
MAX_NGRAM = 8  # ngram_min..ngram_max within 1..MAX_NGRAM: the index holds that many n-grams a token

_HOST = int(Sampling.HOST)


class StrategyDescription(TypedDict):
    slot: int
    cert_id: int
    kind: str
    max_draft: int
    ngram_min: int
    ngram_max: int


@dataclasses.dataclass(eq=False)
class Strategy:
    """An installed strategy and what its lanes did (totals since install)."""

    slot: int
    cert_id: int
    kind: str
    max_draft: int
    ngram_min: int
    ngram_max: int
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # of which the lane took
    gate: dict[int, GateWindow] = dataclasses.field(default_factory=dict)  # by lanes bucket

    def describe(self) -> StrategyDescription:
        return StrategyDescription(slot=self.slot, cert_id=self.cert_id, kind=self.kind, max_draft=self.max_draft,
                    ngram_min=self.ngram_min, ngram_max=self.ngram_max)


class StrategyTable:
    """The executor's installed strategies by slot; cert ids count from 1."""

    def __init__(self) -> None:
        self.slots: dict[int, Strategy] = {}
        self.next_cert = 1

    def install(self, slot: int, kind: str, max_draft: int, ngram_min: int, ngram_max: int) -> Strategy:
        st = Strategy(slot, self.next_cert, kind, max_draft, ngram_min, ngram_max)
        self.next_cert += 1
        self.slots[slot] = st
        return st

    def get(self, slot: int) -> Strategy | None:
        return self.slots.get(slot)

    def __contains__(self, slot: int) -> bool:
        return slot in self.slots

    def __iter__(self) -> Iterator[Strategy]:
        return iter(sorted(self.slots.values(), key=lambda s: s.slot))


def unsupported_because(runtime: Runtime) -> str | None:
    """Why this runtime cannot verify drafts, or None when it can: a draft is
    checked with one step_rows feed and cut back with seq_truncate to any length."""
    if not runtime.desc.truncate_partial:
        return "drafting needs a runtime that truncates to any length (this one is exact_only)"
    if runtime.step_rows([]) is None:
        return "drafting needs step_rows (a row for every fed token); this runtime has none"
    return None


def drafts(sampling: int, grammar_handle: int, bias: object, want_logprobs: int) -> bool:
    """Whether an admit naming a strategy drafts (see the module docstring)."""
    return sampling != _HOST and not grammar_handle and bias is None and not want_logprobs


def propose(tokens: Sequence[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """The draft of up to k tokens for this history (the reference LaneSpec.propose keeps to)."""
    n_tok = len(tokens)
    for n in range(min(ngram_max, n_tok - 1), ngram_min - 1, -1):
        suffix = list(tokens[n_tok - n:])
        for j in range(n_tok - n - 1, -1, -1):
            if list(tokens[j:j + n]) == suffix:
                return _copy_on(tokens, j + n, k)
    return []


def _copy_on(tokens: Sequence[int], src: int, k: int) -> list[int]:
    """tokens[src:src + k], continued by the draft itself past the end."""
    n_tok = len(tokens)
    out: list[int] = []
    for i in range(k):
        p = src + i
        out.append(tokens[p] if p < n_tok else out[p - n_tok])
    return out


MAX_PAUSE = 32  # rounds a lane whose drafts keep missing goes without one, at most


class LaneSpec:
    """A drafting lane's state: its strategy, the n-gram index of its
    history, and how deep it drafts now (depth follows acceptance: a draft
    taken whole doubles it up to max_draft; one cut short sets it to what
    was taken plus one, so a lane whose drafts miss drafts one token). A
    draft of which nothing was taken pauses the lane's drafting for 2, 4,
    8 ... rounds (up to MAX_PAUSE) while they keep missing: a verification
    that takes nothing costs a feed's rows for no token."""

    __slots__ = ("_index", "_seen", "depth", "misses", "pause", "strategy")

    def __init__(self, strategy: Strategy):
        self.strategy = strategy
        self.depth = strategy.max_draft
        self.misses = 0  # drafts in a row of which nothing was taken
        self.pause = 0  # rounds left without a draft
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> start of its latest occurrence with a follower
        self._seen = 0  # history length the index covers

    def _catch_up(self, tokens: Sequence[int]) -> None:
        n_tok = len(tokens)
        if n_tok < self._seen:  # the history was cut back (never in a live lane): index it afresh
            self._index.clear()
            self._seen = 0
        lo, hi = self.strategy.ngram_min, self.strategy.ngram_max
        index = self._index
        # An n-gram is indexed once the token after it is known: those ending at seen-1 .. n_tok-2.
        for end in range(max(0, self._seen - 1), n_tok - 1):
            for n in range(lo, min(hi, end + 1) + 1):
                index[tuple(tokens[end - n + 1:end + 1])] = end - n + 1
        self._seen = n_tok

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens after `tokens` (the lane's committed tokens)."""
        if k <= 0:
            return []
        if self.pause:
            self.pause -= 1
            return []
        self._catch_up(tokens)
        n_tok = len(tokens)
        st = self.strategy
        for n in range(min(st.ngram_max, n_tok - 1), st.ngram_min - 1, -1):
            j = self._index.get(tuple(tokens[n_tok - n:]))
            if j is not None:
                return _copy_on(tokens, j + n, k)
        return []

    def verified(self, proposed: int, accepted: int) -> None:
        st = self.strategy
        st.proposed += proposed
        st.accepted += accepted
        self.depth = min(st.max_draft, 2 * self.depth if accepted == proposed else accepted + 1)
        self.misses = self.misses + 1 if accepted == 0 else 0
        self.pause = min(MAX_PAUSE, 1 << self.misses) if self.misses else 0
