"""The keep/stop gate of speculation: does drafting pay, per strategy and
batch size?

Each tick a strategy's lanes decode in, the gate decides whether they draft
(`decide`), and afterwards the tick's decode seconds and the tokens its
decode rounds emitted are recorded against that decision (`record`). The
figures are kept per strategy and per bucket of decoding lanes (1, 2, 4, ...
MAX_BUCKET), since what a draft costs depends on the batch it rides in. Per
bucket, a GateWindow keeps the last WINDOW samples of each kind and answers:

- explore: until each kind has MIN_SAMPLES samples, draft until drafting has
  them, then not until plain decoding has them;
- on (draft seconds per token <= MARGIN (0.9) x plain seconds per token: a draft
  must pay clearly, since at a tie the two figures' noise decides): draft, but every
  REFRESH_EVERY-th decision decodes plainly, so the plain figure stays fresh;
- off (drafting costs more per token): decode plainly; after PROBE_AFTER
  decisions the draft figure is dropped and drafting is explored again.

Only whether drafts are made depends on the gate, never a token: a drafting
lane's tokens are the tokens it would pick without drafts. The gate sees only
the seconds it is given (the executor's clock, which tests replace), so its
decisions are a function of what was recorded. `force` overrides it: True
always drafts, False never (a benchmark's or a test's switch).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, TypedDict

from superfluid.executor.speculation import StrategyDescription

if TYPE_CHECKING:
    from superfluid.executor.speculation import Strategy, StrategyTable

WINDOW = 16
MARGIN = 0.9
MIN_SAMPLES = 3
REFRESH_EVERY = 32
PROBE_AFTER = 256  # a probe drafts MIN_SAMPLES ticks: where drafting costs 2x, ~1% of the time
MAX_BUCKET = 128  # decoding lanes past this share its figures


class GateFigures(TypedDict):
    state: str  # "explore", "on", "off"
    draft_s_per_token: float | None
    plain_s_per_token: float | None
    draft_samples: int
    plain_samples: int
    decisions: int
    probes: int


class BucketFigures(GateFigures):
    lanes: int


class StrategyFigures(StrategyDescription):
    proposed: int
    accepted: int
    acceptance: float | None  # accepted / proposed; None before any draft
    buckets: list[BucketFigures]


class GateSnapshot(TypedDict):
    force: bool | None
    strategies: list[StrategyFigures]


def bucket(lanes: int) -> int:
    """The power of two at or above `lanes` (at most MAX_BUCKET)."""
    return min(MAX_BUCKET, 1 << max(0, lanes - 1).bit_length())


class GateWindow:
    """One strategy's gate at one batch bucket."""

    __slots__ = ("decisions", "draft", "plain", "probes", "since", "state")

    def __init__(self) -> None:
        self.draft: deque[tuple[float, int]] = deque(maxlen=WINDOW)  # (seconds, tokens) of drafting ticks
        self.plain: deque[tuple[float, int]] = deque(maxlen=WINDOW)
        self.state = "explore"
        self.since = 0  # decisions since the state began
        self.decisions = 0
        self.probes = 0  # times drafting was explored again after it stopped

    @staticmethod
    def per_token(samples: deque[tuple[float, int]]) -> float | None:
        tokens = sum(n for _, n in samples)
        return sum(s for s, _ in samples) / tokens if tokens else None

    def _settle(self) -> None:
        """Leave explore once both figures stand; on or off by them."""
        if len(self.draft) < MIN_SAMPLES or len(self.plain) < MIN_SAMPLES:
            return
        draft, plain = self.per_token(self.draft), self.per_token(self.plain)
        assert draft is not None and plain is not None  # MIN_SAMPLES records, each of tokens > 0
        state = "on" if draft <= MARGIN * plain else "off"
        if state != self.state:
            self.state, self.since = state, 0

    def decide(self) -> bool:
        self.decisions += 1
        self._settle()
        if self.state == "off" and self.since >= PROBE_AFTER:
            self.draft.clear()
            self.state, self.since = "explore", 0
            self.probes += 1
        self.since += 1
        if self.state == "explore":
            return len(self.draft) < MIN_SAMPLES
        if self.state == "on":
            return self.since % REFRESH_EVERY != 0
        return False

    def record(self, drafted: bool, seconds: float, tokens: int) -> None:
        (self.draft if drafted else self.plain).append((seconds, tokens))
        self._settle()

    def figures(self) -> GateFigures:
        return GateFigures(state=self.state, draft_s_per_token=self.per_token(self.draft),
                    plain_s_per_token=self.per_token(self.plain), draft_samples=len(self.draft),
                    plain_samples=len(self.plain), decisions=self.decisions, probes=self.probes)


class SpecGate:
    """The gate over an executor's strategies (spec.StrategyTable): the
    windows live on each Strategy, so a replaced strategy's lanes keep theirs."""

    def __init__(self, strategies: StrategyTable) -> None:
        self.strategies = strategies
        self.force: bool | None = None
        self.changes = 0  # bumped by every decision and record: a reader's cue that figures moved

    def _window(self, strategy: Strategy, lanes: int) -> GateWindow:
        b = bucket(lanes)
        w = strategy.gate.get(b)
        if w is None:
            w = strategy.gate[b] = GateWindow()
        return w

    def decide(self, strategy: Strategy, lanes: int) -> bool:
        """Whether `strategy`'s lanes draft in a tick that decodes `lanes` lanes."""
        self.changes += 1
        w = self._window(strategy, lanes)
        drafting = w.decide()
        return drafting if self.force is None else self.force

    def record(self, strategy: Strategy, lanes: int, drafted: bool, seconds: float, tokens: int) -> None:
        """A tick's decode: `seconds` for `tokens` emitted by decode rounds."""
        if tokens <= 0:
            return
        self.changes += 1
        self._window(strategy, lanes).record(drafted, seconds, tokens)

    def snapshot(self) -> GateSnapshot:
        """Plain data: every installed strategy, its totals and its gate by bucket
        (a replaced strategy is not listed; its lanes go on under its own figures).

        {"force": None | bool, "strategies": [{slot, cert_id, kind, max_draft,
        ngram_min, ngram_max, proposed, accepted, acceptance (accepted /
        proposed, None before any draft), buckets: [{lanes, state ("explore",
        "on", "off"), draft_s_per_token, plain_s_per_token (None before a
        sample), draft_samples, plain_samples, decisions, probes}]}]}"""
        out: list[StrategyFigures] = []
        for st in self.strategies:
            out.append(StrategyFigures(**st.describe(), proposed=st.proposed, accepted=st.accepted,
                                       acceptance=st.accepted / st.proposed if st.proposed else None,
                                       buckets=[BucketFigures(lanes=b, **w.figures())
                                                for b, w in sorted(st.gate.items())]))
        return GateSnapshot(force=self.force, strategies=out)
