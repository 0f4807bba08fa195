"""The runtime under the executor (contract §8): what it can do and how it fails.

The executor never touches tensors. It drives a runtime through these
primitives over opaque sequence ids; rows come back as numpy float32 arrays.
A runtime owns its cells: the executor only asks.

Errors are typed so the executor can tell a lane's failure from the worker's:
CapacityError and LaneFault fault the lanes of the step; UnknownSequence,
OutOfBounds and Unsupported are the caller's mistakes (the executor treats
them as INTERNAL lane faults); FatalError means the runtime's state is
unknown and the worker must exit.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from superfluid.abi import RuntimeFlag
from superfluid.abi.records import RuntimeDesc

# ------------------------------------------------------------------ errors


class RuntimeFailure(Exception):
    """Base of every runtime error."""


class CapacityError(RuntimeFailure):
    """Not enough free cells or sequence slots; nothing was changed."""


class LaneFault(RuntimeFailure):
    """A failure that belongs to the lanes of the step (`code`: SF_FAULT_*)."""

    def __init__(self, code: int, message: str = ""):
        super().__init__(message or f"lane fault {code}")
        self.code = code


class FatalError(RuntimeFailure):
    """The runtime's state is unknown (device lost, a step half-applied)."""


class Unsupported(RuntimeFailure):
    """This runtime cannot do that (e.g. export on a runtime without it)."""


class UnknownSequence(RuntimeFailure):
    """No live sequence has that id."""


class OutOfBounds(RuntimeFailure):
    """A length, count or token outside what the sequence or model allows."""


# ------------------------------------------------------------ descriptions


@dataclasses.dataclass(frozen=True)
class RuntimeDescription:
    """contract §8: what a runtime can do, stated once."""

    runtime_id: str
    vocab_size: int
    max_seq_len: int
    max_batch: int
    max_seqs: int = 0  # 0 = unbounded
    page: int = 16
    truncate_partial: bool = True
    copy_shares_cells: bool = False
    takeover_preferred: bool = False
    prefill_step_tokens: int = 0  # 0 = one step
    engine_sampling: bool = False
    engine_draws: bool = False
    verify_batches: bool = False
    exact_only: bool = False
    # The worker's parallel layout (DESCRIBE's `parallel`; not in the RuntimeDesc
    # record, so from_record leaves them 1): tp rank processes run the model, on
    # nnodes machines. A lane's rows do not depend on them.
    tp: int = 1
    nnodes: int = 1
    # DESCRIBE's `numeric` (not in the record either): the arithmetic's class
    # (workers of one class give the same rows: kernels/cpu.py) and the ISA
    # or device it runs on.
    numeric_class: str = ""
    isa: str = ""

    _FLAGS = (
        ("truncate_partial", RuntimeFlag.TRUNCATE_PARTIAL),
        ("copy_shares_cells", RuntimeFlag.COPY_SHARES_CELLS),
        ("takeover_preferred", RuntimeFlag.TAKEOVER_PREFERRED),
        ("engine_sampling", RuntimeFlag.ENGINE_SAMPLING),
        ("engine_draws", RuntimeFlag.ENGINE_DRAWS),
        ("verify_batches", RuntimeFlag.VERIFY_BATCHES),
        ("exact_only", RuntimeFlag.EXACT_ONLY),
    )

    def __post_init__(self) -> None:
        for name in ("tp", "nnodes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"RuntimeDescription.{name} must be an int >= 1, got {v!r}")
        if self.nnodes > self.tp:
            raise ValueError(f"RuntimeDescription.nnodes ({self.nnodes}) exceeds tp ({self.tp}): "
                             "every machine runs at least one rank")

    def to_record(self) -> RuntimeDesc:
        flags = 0
        for name, bit in self._FLAGS:
            if getattr(self, name):
                flags |= int(bit)
        return RuntimeDesc(self.runtime_id.encode()[:32], self.vocab_size, self.max_batch, self.max_seq_len,
                           self.max_seqs, self.page, self.prefill_step_tokens, flags)

    @classmethod
    def from_record(cls, r: RuntimeDesc) -> RuntimeDescription:
        rid = r.runtime_id.decode() if isinstance(r.runtime_id, bytes) else r.runtime_id
        return cls(runtime_id=rid, vocab_size=r.vocab_size, max_seq_len=r.max_seq_len, max_batch=r.max_batch,
                   max_seqs=r.max_seqs, page=r.page, prefill_step_tokens=r.prefill_step_tokens,
                   **{name: bool(r.flags & bit) for name, bit in cls._FLAGS})


@dataclasses.dataclass(frozen=True)
class Feed:
    """Tokens to append to a sequence in one step; `wants_row`: return the
    logits row of the last token. `decode`: one token of a decode round
    (sampled, committed, replayed, or the prompt's held-back last one): a
    recurrent runtime applies its one-token update, whose arithmetic differs
    from its chunked prefill's, so the executor feeds every position the
    same way on every path (first run, replay, seed); others ignore it."""

    seq: int
    tokens: Sequence[int]
    wants_row: bool = False
    decode: bool = False


class SampleSpec(NamedTuple):
    """On-device sampling of a feed's row (step_sampled). temperature <= 0 is
    greedy; the draw is a pure function of (row, these params, rng_position).
    (A named tuple: one is made per lane per decode round.)"""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    min_p: float = 0.0
    rng_position: int = 0


class TokenMasks(NamedTuple):
    """Grammar masks for some rows of a step_sampled batch, applied to a row
    before anything else (contract §5): a token whose bit is clear gets -inf.

    bits: int32 [n, ceil(vocab_size / 32)]; token t is allowed when bit t % 32
    of word t // 32 is set (llguidance's bitmask layout). rows: the feed index
    each bits row masks (distinct), or None when bits has one row per feed.
    Feeds not named are unmasked and cost nothing."""

    bits: np.ndarray
    rows: Sequence[int] | None = None


def check_masks(masks: TokenMasks | None, n_feeds: int, vocab_size: int) -> TokenMasks | None:
    """masks checked against a step of n_feeds (OutOfBounds, before the step
    changes anything), with rows as a list; None when it masks no feed."""
    if masks is None:
        return None
    bits, rows = masks
    words = (vocab_size + 31) // 32
    if (not isinstance(bits, np.ndarray) or bits.dtype != np.int32 or bits.ndim != 2
            or bits.shape[1] != words):
        got = f"{bits.dtype} {bits.shape}" if isinstance(bits, np.ndarray) else type(bits).__name__
        raise OutOfBounds(f"a token mask must be int32 [n, {words}], got {got}")
    if rows is None:
        if bits.shape[0] != n_feeds:
            raise OutOfBounds(f"a token mask of {bits.shape[0]} rows for {n_feeds} feeds")
        rows = list(range(n_feeds))
    else:
        rows = [int(r) for r in rows]
        if len(rows) != bits.shape[0]:
            raise OutOfBounds(f"{len(rows)} mask rows for a token mask of {bits.shape[0]} rows")
        if rows and (min(rows) < 0 or max(rows) >= n_feeds or len(set(rows)) != len(rows)):
            raise OutOfBounds(f"mask rows must be distinct feeds of 0..{n_feeds - 1}")
    return TokenMasks(bits, rows) if rows else None


# What export_bytes_max allows for a blob's own header, by default.
EXPORT_HEADER_BYTES = 4096


class MemCounters(NamedTuple):
    """(A named tuple: the executor reads one every tick.)"""

    cells_total: int  # 0 = no cell limit
    cells_used: int
    allocated_bytes: int
    seqs: int = 0


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    size: int
    eos: frozenset[int]
    specials: dict[str, int] = dataclasses.field(default_factory=dict)


# step_sampled's token for a feed whose logits row was not finite: no token
# is drawn from garbage; the executor faults the lane SF_FAULT_NUMERIC.
NONFINITE = -1


def row_finite(row: np.ndarray) -> bool:
    """Whether a logits row can be sampled: no NaN, no +inf, some finite value
    (-inf alone is a banned token). One reduction: a NaN or +inf is the max."""
    return bool(np.isfinite(row.max()))


# ------------------------------------------------------------ the interface


class Runtime(abc.ABC):
    """The primitives of contract §8. Sequence ids are opaque ints > 0."""

    desc: RuntimeDescription
    # Fault injection (engine/fault_runtime.py): sequences whose logits rows
    # of the next step_sampled are NaN before sampling (a runtime that samples
    # on the device honours it; rows step returns are poisoned by the wrapper).
    nan_rows: frozenset[int] = frozenset()

    @abc.abstractmethod
    def seq_create(self) -> int:
        """A new empty sequence. CapacityError when max_seqs are live."""

    @abc.abstractmethod
    def seq_copy(self, src: int, dst: int, n: int) -> None:
        """Make `dst` hold the first n cells of `src` (what dst held is
        dropped). Shares full blocks where `copy_shares_cells`."""

    @abc.abstractmethod
    def seq_truncate(self, seq: int, n: int) -> None:
        """Keep the first n cells (n <= len; OutOfBounds otherwise)."""

    def seq_settle(self, seq: int) -> None:
        """Make the sequence hold what a prefill of all its tokens would
        leave (a recurrent runtime redoes the positions decode feeds fed, see
        Feed.decode), so that whatever continues from it (a seeded lane, an
        export) continues as from a fresh prefill. A no-op where feeds leave
        the same state either way."""

    @abc.abstractmethod
    def seq_free(self, seq: int) -> None:
        """Drop a sequence and release its cells (UnknownSequence if none)."""

    @abc.abstractmethod
    def seq_len(self, seq: int) -> int:
        """Cells the sequence holds."""

    @abc.abstractmethod
    def step(self, feeds: Sequence[Feed]) -> list[np.ndarray]:
        """Append every feed's tokens in one forward pass; the logits row
        (float32, vocab_size) of the last token of each feed that wants one,
        in feed order. All or nothing: on an error no sequence changed."""

    def step_rows(self, feeds: Sequence[Feed]) -> list[np.ndarray] | None:
        """As step, but a row for every fed token: one (n_tokens, vocab)
        array per feed. None where the runtime cannot."""
        return None

    def step_sampled(self, feeds: Sequence[Feed], specs: Sequence[SampleSpec],
                     masks: TokenMasks | None = None) -> list[int] | None:
        """As step (every feed wants a row), but the row of each feed is
        sampled on the device with its spec, after its grammar mask if
        `masks` names it; the tokens, in feed order, NONFINITE for a feed
        whose row was not finite (row_finite). None where the runtime does
        not sample (the caller samples rows)."""
        return None

    @property
    def tokenizer_json(self) -> str | None:
        """The text of the checkpoint's tokenizer.json, which grammars compile
        against (executor/grammar.py); None: no tokenizer, so no grammars."""
        return None

    @abc.abstractmethod
    def seq_export(self, seq: int) -> bytes:
        """The sequence's cells as bytes (Unsupported where it cannot)."""

    @abc.abstractmethod
    def seq_import(self, seq: int, data: bytes) -> int:
        """Load exported cells into an empty sequence; the cells loaded."""

    def export_bytes_max(self) -> int:
        """The most bytes seq_export returns for any sequence (an import from a
        file reads no more): by default the cells of the longest sequence and a header."""
        return self.cell_bytes() * self.desc.max_seq_len + EXPORT_HEADER_BYTES

    @abc.abstractmethod
    def mem_counters(self) -> MemCounters:
        ...

    @abc.abstractmethod
    def cells_released(self, seqs: Sequence[int]) -> int:
        """Cells that freeing all of `seqs` together would release (shared
        cells count only when every holder is among them)."""

    @abc.abstractmethod
    def vocabulary(self) -> Vocabulary:
        ...

    def is_eos(self, token: int) -> bool:
        return token in self.vocabulary().eos

    def cell_bytes(self) -> int:
        """Bytes one cell holds (what a cache entry of n cells costs)."""
        m = self.mem_counters()
        return m.allocated_bytes // m.cells_total if m.cells_total else 0

    def idle(self) -> None:
        """Nothing comes for the runtime until the executor's next plan (a
        tick is over): a runtime with threads of its own lets them sleep now,
        so their spinning does not take the core the planner needs."""

    def close(self) -> None:
        """Release what the runtime holds (memory, threads)."""
