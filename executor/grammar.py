"""Grammars (contract §3 step 4, §5, §7) over llguidance: compile once, a matcher per lane.

REGISTER_GRAMMAR compiles text of a kind (json_schema, regex, lark, gbnf,
choice) against the runtime's tokenizer into a Grammar, which the registry
keeps under a handle. A lane borrows it (one lane at a time, contract §3 step 4)
as a Matcher: a copy of the grammar's fresh matcher that has replayed the
prompt's tail, and that answers only "mask", "accept" and "complete". The
masks of a round's grammar lanes fill in one call on llguidance's thread pool
(it releases the GIL; in this thread where the pool would have one thread)
into an int32 bitmask [n, ceil(V/32)]: the rows the
samplers apply first (engine.runtime.TokenMasks, executor.host_sampling.pick).

EOS: the mask allows the eos ids exactly when the grammar may end here
(llguidance's accepting state); once nothing but EOS can follow, the grammar
is complete (is_complete, finish GRAMMAR).

llguidance's sharp edge: a matcher that consumes a token the grammar refuses
enters an error state it never leaves (rollback fails too). accept() and
replay() therefore try the token first, so a refusal leaves the matcher as it
was; a matcher in error anyway (a parser limit hit while masking) can be
rebuilt by replaying its tokens into a fresh copy (rebuild).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, cast

import llguidance
import numpy as np
from llguidance import LLExecutor, LLMatcher, LLParserLimits, LLTokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

    from superfluid.engine.runtime import Runtime

KINDS = ("json_schema", "regex", "lark", "gbnf", "choice")
MAX_GRAMMARS = 1024  # registered at once (each holds a compiled lexer: up to MBs at vocab 32k)
# An untrained model loops on flexible JSON whitespace; a schema may still opt in
# through its own "x-guidance" (these are defaults, under the schema's).
JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}
_LIMITS = LLParserLimits(verbose_errors=False)  # a message names the problem, not the parser state


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what this process may run on (a container's share)
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class GrammarError(ValueError):
    """A grammar the library refuses (its message, as it gave it)."""


class GrammarsUnsupported(Exception):
    """The runtime has no tokenizer (or not one llguidance can read)."""


def _message(text: str) -> str:
    """A library message without llguidance's debugging tails."""
    return text.split("<state>")[0].split("<non-verbose/>")[0].strip() or "the grammar is invalid"


def make_tokenizer(tokenizer_json: str, vocab_size: int, eos: Iterable[int]) -> LLTokenizer:
    """llguidance's tokenizer over a tokenizer.json text, sized to the model's
    vocabulary (ids the tokenizer lacks are never allowed) with the runtime's
    eos ids (tokenizer.json does not say which ids end a turn)."""
    eos = sorted(eos)
    try:
        return LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos or None)
    except Exception as e:  # llguidance raises ValueError / RuntimeError on what it cannot read
        raise GrammarsUnsupported(f"the runtime's tokenizer.json cannot be used for grammars: {e}") from e


def grammar_source(kind: str, text: str | Sequence[str]) -> str:
    """llguidance's grammar (its JSON form) for text of a kind; GrammarError on
    text it cannot read (a grammar it reads but refuses fails in compile)."""
    if kind not in KINDS:
        raise GrammarError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    if kind == "choice":
        if isinstance(text, str) or not text or not all(isinstance(c, str) for c in text):
            raise GrammarError("choice needs a non-empty list of strings")
        # One Lark alternative per string; JSON string escapes are Lark's.
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in text))
    if not isinstance(text, str):
        raise GrammarError(f"a {kind} grammar is a string, got {type(text).__name__}")
    try:
        if kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)
        return llguidance.grammar_from(cast("llguidance.GrammarFormat", kind), text)  # one of KINDS
    except Exception as e:  # ValueError, and what the GBNF converter raises
        raise GrammarError(_message(str(e))) from e


class Grammar:
    """A compiled grammar: llguidance's source and a matcher before any token,
    which every lane's matcher is a copy of (no recompiling per lane)."""

    __slots__ = ("_fresh", "compile_us", "eos", "kind", "source", "vocab_size")

    def __init__(self, tokenizer: LLTokenizer, kind: str, text: str | Sequence[str]):
        self.kind = kind
        self.eos = frozenset(tokenizer.eos_tokens)
        self.vocab_size = tokenizer.vocab_size
        self.source = grammar_source(kind, text)
        t0 = time.perf_counter_ns()
        m = LLMatcher(tokenizer, self.source, log_level=0, limits=_LIMITS)
        self.compile_us = (time.perf_counter_ns() - t0) // 1000
        if m.is_error():
            raise GrammarError(_message(m.get_error()))
        self._fresh = m

    def matcher(self, replay: Sequence[int] = ()) -> Matcher | None:
        """A fresh matcher that has consumed `replay`; None if the grammar refuses
        any of those tokens."""
        m = Matcher(self)
        return m if m.replay(replay) else None


class Matcher:
    """One lane's position in a grammar. `tokens`: what it has consumed."""

    __slots__ = ("_m", "grammar", "tokens")

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self._m = grammar._fresh.deep_copy()
        self.tokens: list[int] = []

    def replay(self, tokens: Sequence[int]) -> bool:
        """Consume tokens; False (having consumed the ones before it) at the first
        the grammar refuses."""
        tokens = [int(t) for t in tokens]
        # An id outside the vocabulary puts llguidance in its error state: stop before it.
        inside = next((i for i, t in enumerate(tokens) if not 0 <= t < self.grammar.vocab_size), len(tokens))
        n = self._m.try_consume_tokens(tokens[:inside]) if inside else 0
        self.tokens += tokens[:n]
        return n == len(tokens) and not self._m.is_error()

    def accept(self, token: int) -> bool:
        """Consume one sampled token; False if the grammar refuses it (the
        matcher is then as it was). An eos id after completion is accepted as
        a no-op (llguidance refuses anything once stopped)."""
        m = self._m
        if 0 <= token < self.grammar.vocab_size and m.try_consume_tokens([token]) == 1 and not m.is_error():
            self.tokens.append(token)
            return True
        return self.is_complete() and token in self.grammar.eos

    def is_accepting(self) -> bool:
        """The grammar may end here (the mask allows EOS)."""
        return self._m.is_accepting() and not self._m.is_error()

    def is_complete(self) -> bool:
        """Nothing but EOS can follow: the lane finishes GRAMMAR."""
        return self._m.is_stopped() and not self._m.is_error()

    @property
    def error(self) -> str:
        """Why the matcher is in llguidance's error state; "" when it is not."""
        return _message(self._m.get_error()) if self._m.is_error() else ""

    def fill(self, row: np.ndarray) -> bool:
        """Write the next token's mask into `row` (int32 [ceil(V/32)], C-contiguous);
        False if the matcher is in error (the mask then allows only EOS)."""
        if row.dtype != np.int32 or row.ndim != 1 or not row.flags.c_contiguous:
            raise ValueError("a mask row is a C-contiguous int32 vector")
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        return not self._m.is_error()

    def rollback(self, n: int) -> bool:
        """Forget the last n tokens; rebuilt by replay where llguidance cannot
        roll back (an error state)."""
        if not 0 <= n <= len(self.tokens):
            return False
        if n and not self._m.is_error() and self._m.rollback(n):
            del self.tokens[len(self.tokens) - n:]
            return True
        return self.rebuild(len(self.tokens) - n)

    def rebuild(self, keep: int | None = None) -> bool:
        """A fresh copy that replays the first `keep` tokens (default: all)."""
        tokens = self.tokens if keep is None else self.tokens[:keep]
        self._m = self.grammar._fresh.deep_copy()
        self.tokens = []
        return self.replay(tokens)

    def copy(self) -> Matcher:
        c = Matcher.__new__(Matcher)
        c.grammar, c._m, c.tokens = self.grammar, self._m.deep_copy(), list(self.tokens)
        return c


class GrammarRegistry:
    """The executor's grammars by handle (Registry.grammars), and which lane
    borrows each.

    A grammar is borrowed by at most one lane at a time (contract §3 step 4): an
    admit borrows it, the lane's retire or fault gives it back. RELEASE_GRAMMAR
    unregisters a handle at once, borrowed or not: the borrowing lane keeps its
    matcher to its end (as lanes keep a released logit bias), and later admits
    no longer know the handle. The tokenizer and the thread pool are made on
    first use, so a worker that never sees a grammar pays for neither."""

    def __init__(self, tokenizer_json: str | None, vocab_size: int, eos: Iterable[int] = (), *,
                 threads: int | None = None, max_grammars: int = MAX_GRAMMARS):
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # int32 words in a mask row
        self.max_grammars = max_grammars
        self._json = tokenizer_json
        self._eos = frozenset(eos)
        # llguidance's default pool: 80% of the CPUs (up to 32). With one thread
        # the pool is a hand-off and no parallelism: fill then runs in this thread.
        self.threads = threads if threads is not None else min(32, max(1, int(0.8 * _cpus())))
        self._tokenizer: LLTokenizer | None = None
        self._pool: LLExecutor | None = None
        self._grammars: dict[int, Grammar] = {}
        self._borrowers: dict[int, int] = {}  # handle -> lane tag

    @classmethod
    def for_runtime(cls, runtime: Runtime, **kw: int) -> GrammarRegistry:
        """The registry over a runtime's tokenizer (engine.runtime.Runtime.tokenizer_json)."""
        return cls(runtime.tokenizer_json, runtime.desc.vocab_size, runtime.vocabulary().eos, **kw)

    # ------------------------------------------------------------ handles

    @property
    def supported(self) -> bool:
        """Whether the runtime has a tokenizer (its checkpoint had tokenizer.json)."""
        return self._json is not None

    @property
    def tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            if self._json is None:
                raise GrammarsUnsupported("grammars need a tokenizer: this runtime has none "
                                          "(no tokenizer.json in its checkpoint)")
            self._tokenizer = make_tokenizer(self._json, self.vocab_size, self._eos)
        return self._tokenizer

    def compile(self, kind: str, text: str | Sequence[str]) -> Grammar:
        """GrammarError with the library's message; GrammarsUnsupported without a tokenizer."""
        return Grammar(self.tokenizer, kind, text)

    @property
    def full(self) -> bool:
        return len(self._grammars) >= self.max_grammars

    def add(self, handle: int, grammar: Grammar) -> None:
        self._grammars[handle] = grammar

    def release(self, handle: int) -> bool:
        """Unregister a handle; False if it was not registered."""
        self._borrowers.pop(handle, None)
        return self._grammars.pop(handle, None) is not None

    def get(self, handle: int) -> Grammar | None:
        return self._grammars.get(handle)

    def __contains__(self, handle: object) -> bool:
        return handle in self._grammars

    def __len__(self) -> int:
        return len(self._grammars)

    def handles(self) -> list[int]:
        return sorted(self._grammars)

    # ---------------------------------------------------------- borrowing

    def borrower(self, handle: int) -> int | None:
        """The lane that borrows the grammar; None when none does."""
        return self._borrowers.get(handle)

    def available(self, handle: int) -> bool:
        """Registered and borrowed by no lane: an admit may take it."""
        return handle in self._grammars and handle not in self._borrowers

    def cursor(self, handle: int, replay: Sequence[int] = ()) -> Matcher | None:
        """A fresh matcher of the grammar that has replayed `replay` (an admit's
        last grammar_replay prompt tokens); None if the handle is unknown or the
        grammar refuses a token. Changes nothing: a check may call it."""
        g = self._grammars.get(handle)
        return None if g is None else g.matcher(replay)

    def borrow(self, handle: int, lane_tag: int) -> None:
        if not self.available(handle):
            raise KeyError(f"grammar {handle} is not registered, or lane {self._borrowers.get(handle)} "
                           f"borrows it")
        self._borrowers[handle] = lane_tag

    def give_back(self, handle: int, lane_tag: int) -> None:
        """The lane's end (retire or fault); nothing if the handle was released meanwhile."""
        if self._borrowers.get(handle) == lane_tag:
            del self._borrowers[handle]

    # -------------------------------------------------------------- masks

    def bitmask(self, n: int, *, fill: bool = True) -> np.ndarray:
        """An int32 [n, words] mask array for fill (every token allowed; fill=False:
        uninitialised, for a caller whose fill writes every row)."""
        if not fill:
            return np.empty((n, self.words), dtype=np.int32)
        return np.full((n, self.words), -1, dtype=np.int32)

    def fill(self, pairs: Sequence[tuple[Matcher, int]], bits: np.ndarray) -> list[int]:
        """Write each matcher's next-token mask into row `row` of bits, for all the
        pairs (matcher, row) in one call on llguidance's thread pool (the GIL is
        released meanwhile), or one after another in this thread where the pool
        would have one thread (`threads`: 80% of the CPUs by default). The
        positions in `pairs` of matchers in error (the wiring faults those
        lanes: GRAMMAR_OVERFLOW); their rows allow only EOS."""
        if (bits.dtype != np.int32 or bits.ndim != 2 or bits.shape[1] != self.words
                or not bits.flags.c_contiguous):
            raise ValueError(f"a mask array is C-contiguous int32 [n, {self.words}]")
        rows = [r for _, r in pairs]
        if len(set(rows)) != len(rows) or len({id(m) for m, _ in pairs}) != len(pairs) or (
                rows and (min(rows) < 0 or max(rows) >= bits.shape[0])):
            raise ValueError(f"mask rows must be distinct rows of 0..{bits.shape[0] - 1}, one per matcher")
        if len(pairs) == 1 or (pairs and self.threads < 2):
            # No thread hand-off where nothing runs in parallel: a pool of one thread
            # only adds it (32 masks at vocab 32k on a busy 2-core machine: ~0.4 ms
            # here, ~1 ms through the pool; a pool of 2 there was no faster either).
            base, row_bytes = bits.ctypes.data, self.words * 4
            for m, r in pairs:
                m._m.unsafe_compute_mask_ptr(base + r * row_bytes, row_bytes)
        elif pairs:
            if self._pool is None:
                self._pool = LLExecutor(self.threads)
            self._pool.unsafe_compute_mask_ptr([(m._m, r) for m, r in pairs], bits.ctypes.data,
                                               self.words * 4, bits.shape[0])
        return [i for i, (m, _) in enumerate(pairs) if m._m.is_error()]
