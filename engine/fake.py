"""A deterministic fake runtime (contract §8) for executor tests and the tick benchmark.

A sequence is the list of tokens it holds, one cell each. The row of a token
is a pure function of its sequence's history up to and including it: a
polynomial hash chained over the history, mixed, picks three rows of fixed
random tables that are summed in float32. Nothing else in a step touches it,
so batch invariance and chunking invariance hold bitwise by construction, and
greedy decoding does not loop (every position hashes differently).

Cells live in a paged pool of `page`-cell blocks with reference counts, as a
paged KV pool does: `cells_used` counts whole blocks. With
`copy_shares_cells`, a copy shares the source's full blocks and copies its
partial one; a sequence about to write into a partial block someone else
still holds (left by a truncate) first copies it (copy-on-write, one block).

`exact_only` models a recurrent runtime, whose state cannot be cut back:
- seq_truncate(seq, n) only to n == 0 (a reset) or n == len (no-op); any other
  n is OutOfBounds (desc.truncate_partial is False);
- seq_copy(src, dst, n) only of n == len(src) (or n == 0, an empty dst);
  any other n is OutOfBounds;
- export/import move whole sequences, as everywhere;
- a decode feed (Feed.decode, one token) takes "the one-token update": its
  position hashes differently from a prefill's, and so do the rows after it,
  until a prefill feed recomputes the sequence's decoded positions as prefill
  would have (as a recurrent runtime redoes them from its last chunk
  boundary). Rows thus tell which way each position was fed, so a test sees
  an executor that feeds a position one way on a first run and another on a
  replay or after a seed.
The executor lives with this: it keys cache entries by their exact length,
checkpoints a prompt one token short of its end, copies whole entries, takes
an entry over only when it ends where the seed does, and resets a failed
import with truncate(seq, 0).

Fault injection (inject_fault, inject_capacity_fault, inject_fatal) fires
after a call's own checks pass and before it changes anything. A FatalError
poisons the runtime: every later call raises FatalError, as a lost device
would, until clear_faults().

Not modelled: max_batch is stated in desc but not enforced (the executor
chunks decode rounds by it; a prefill step may carry more feeds); an empty
sequence holds no cells.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib
import operator
import struct
import time
import zlib
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Literal

import numpy as np

from superfluid.abi import Fault
from superfluid.engine.runtime import (
    CapacityError,
    FatalError,
    Feed,
    LaneFault,
    MemCounters,
    OutOfBounds,
    Runtime,
    RuntimeDescription,
    SampleSpec,
    TokenMasks,
    UnknownSequence,
    Unsupported,
    Vocabulary,
    check_masks,
)

_M64 = (1 << 64) - 1
_BASE = 0x9E3779B97F4A7C15 | 1  # odd, so the chain is a bijection per token
_DECODED = 0xD1B54A32D192ED03  # an exact_only decode feed's position: mixed in (see the docstring)

# Export blob: magic, version, flags (0), model fingerprint, tokens, crc32 of the body:
# the tokens, then (u32) how many trailing ones decode fed (exact_only).
_BLOB = struct.Struct("<4sHHQII")
_MAGIC = b"SFFK"
_VERSION = 2

FaultSite = Literal["step", "copy", "truncate", "import", "export", "create", "free", "any"]
_SITES = frozenset(("step", "copy", "truncate", "import", "export", "create", "free", "any"))


def _mix64(x: int) -> int:
    """splitmix64's finalizer: every input bit reaches every output bit."""
    z = (x + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


@functools.lru_cache(maxsize=16)
def _tables(seed: int, vocab: int, eos: tuple[int, ...]) -> np.ndarray:
    """Three (K, vocab) float32 tables, K a power of two; shared by runtimes of
    one model and read-only. EOS columns sit low so EOS wins only when a row
    is told to (see _row), yet keeps some mass for sampling."""
    k = 256
    while k > 16 and 3 * k * vocab > (1 << 22):  # ~16 MiB at most
        k //= 2
    rng = np.random.default_rng(seed)
    t = rng.standard_normal((3, k, vocab), dtype=np.float32)
    t[1] *= np.float32(0.5)
    t[2] *= np.float32(0.25)
    t[0][:, list(eos)] -= np.float32(4.0)
    t.flags.writeable = False
    return t


def _host_sampling() -> ModuleType | None:
    """superfluid.kernels.reference_sampler if it is there (the fake also runs without the kernels)."""
    try:
        mod = importlib.import_module("superfluid.kernels.reference_sampler")
    except ImportError:
        return None
    return mod if callable(getattr(mod, "sample", None)) else None


@dataclasses.dataclass
class FakeStats:
    """What the runtime was asked to do; a benchmark subtracts simulated_ns."""

    step_calls: int = 0  # every step/step_rows/step_sampled call, failed ones too
    steps: int = 0  # steps that ran
    tokens_fed: int = 0
    rows: int = 0  # rows returned (step and step_rows)
    sampled: int = 0  # tokens returned by step_sampled
    creates: int = 0
    copies: int = 0
    truncates: int = 0
    frees: int = 0
    exports: int = 0
    imports: int = 0
    faults: int = 0  # injected failures raised
    simulated_ns: int = 0  # cost asked by step_cost/token_cost


@dataclasses.dataclass
class _Seq:
    tokens: list[int]
    chain: list[int]  # the history hash after each token
    blocks: list[int]  # pool blocks holding the cells: ceil(len / page)
    decoded: int = 0  # exact_only: trailing tokens fed by decode feeds since the last prefill


class FakeRuntime(Runtime):
    """See the module docstring. Sizes are in cells; `cells_total` is rounded
    down to whole pages (0 = unlimited)."""

    def __init__(
        self,
        *,
        vocab_size: int = 64,
        max_seq_len: int = 256,
        max_batch: int = 64,
        max_seqs: int = 0,
        page: int = 16,
        cells_total: int = 0,
        copy_shares_cells: bool | None = None,  # None: share unless exact_only
        exact_only: bool = False,
        takeover_preferred: bool = False,
        verify_batches: bool = True,
        prefill_step_tokens: int = 0,
        eos_ids: Iterable[int] | None = None,
        eos_rate: float = 0.02,
        engine_sampling: bool = False,
        engine_draws: bool = False,
        step_cost: float = 0.0,
        token_cost: float = 0.0,
        cost_mode: Literal["spin", "sleep"] = "spin",
        bytes_per_cell: int = 128,
        seed: int = 0,
    ):
        if vocab_size < 2 or max_seq_len < 1 or page < 1 or max_batch < 1:
            raise ValueError("vocab_size >= 2, max_seq_len, page and max_batch >= 1")
        eos = tuple(sorted(set(eos_ids))) if eos_ids is not None else (vocab_size - 1,)
        if not eos or not all(0 <= e < vocab_size for e in eos):
            raise ValueError(f"eos_ids must be non-empty ids below {vocab_size}")
        if 0 < cells_total < page:
            raise ValueError(f"cells_total {cells_total} is less than a page ({page})")
        if cost_mode not in ("spin", "sleep"):
            raise ValueError("cost_mode is 'spin' or 'sleep'")
        if copy_shares_cells is None:
            copy_shares_cells = not exact_only  # a recurrent state has no pages to share
        self._sampling = _host_sampling() if engine_sampling and engine_draws else None
        self.desc = RuntimeDescription(
            runtime_id="fake",
            vocab_size=vocab_size,
            max_seq_len=max_seq_len,
            max_batch=max_batch,
            max_seqs=max_seqs,
            page=page,
            truncate_partial=not exact_only,
            copy_shares_cells=copy_shares_cells,
            takeover_preferred=takeover_preferred,
            prefill_step_tokens=prefill_step_tokens,
            engine_sampling=engine_sampling,
            engine_draws=self._sampling is not None,
            verify_batches=verify_batches,
            exact_only=exact_only,
        )
        self._page = page
        self._blocks_total = cells_total // page  # 0 = unlimited
        self._bytes_per_cell = bytes_per_cell
        self._eos = eos
        self._eos_set = frozenset(eos)
        self._eos_cut = round(eos_rate * 65536)
        self._tables = _tables(seed & _M64, vocab_size, eos)
        self._kmask = self._tables.shape[1] - 1
        self._salt = _mix64((seed & _M64) ^ 0x5F0F)
        # What the rows depend on: a blob from a runtime with other rows is refused.
        fp = self._salt
        for x in (vocab_size, self._eos_cut, *eos):
            fp = _mix64(fp ^ x)
        self._fingerprint = fp
        self._step_cost = step_cost
        self._token_cost = token_cost
        self._cost_mode = cost_mode

        self._seqs: dict[int, _Seq] = {}
        self._next_seq = 1  # ids are never reused, so a stale id stays unknown
        self._rc: dict[int, int] = {}  # block -> holders
        self._next_block = 0

        self._lane_faults: dict[int, list[int]] = {}  # seq -> [code, times left]
        self._capacity_faults: dict[str, int] = {}  # site -> times left
        self._fatal_faults: dict[str, int] = {}
        self._poisoned = False
        self._closed = False
        self.stats = FakeStats()

    # ------------------------------------------------------------ faults

    def inject_fault(self, seq: int, code: int = int(Fault.INTERNAL), times: int = 1) -> None:
        """The next `times` steps that feed `seq` raise LaneFault(code), changing nothing."""
        self._lane_faults[seq] = [int(code), times]

    def inject_capacity_fault(self, times: int = 1, on: FaultSite = "step") -> None:
        """The next `times` calls at `on` raise CapacityError, changing nothing."""
        self._capacity_faults[self._site(on)] = times

    def inject_fatal(self, on: FaultSite = "step", times: int = 1) -> None:
        """The next call at `on` raises FatalError; the runtime is poisoned after."""
        self._fatal_faults[self._site(on)] = times

    def clear_faults(self) -> None:
        """Drop pending injections and the poison (the fake's state is intact)."""
        self._lane_faults.clear()
        self._capacity_faults.clear()
        self._fatal_faults.clear()
        self._poisoned = False

    @property
    def poisoned(self) -> bool:
        return self._poisoned

    @staticmethod
    def _site(on: str) -> str:
        if on not in _SITES:
            raise ValueError(f"fault site {on!r} not one of {sorted(_SITES)}")
        return on

    @staticmethod
    def _take(pending: dict[str, int], site: str) -> bool:
        for key in (site, "any"):
            if pending.get(key, 0) > 0:
                pending[key] -= 1
                return True
        return False

    def _alive(self) -> None:
        if self._closed:
            raise FatalError("runtime closed")
        if self._poisoned:
            raise FatalError("runtime state unknown after an earlier fatal error")

    def _injected(self, site: str, seqs: Sequence[int] = ()) -> None:
        """Raise what was injected for this call, after its checks passed."""
        if self._take(self._fatal_faults, site):
            self._poisoned = True
            self.stats.faults += 1
            raise FatalError(f"injected fatal error at {site}")
        fault = None
        for s in seqs:
            pending = self._lane_faults.get(s)
            if pending and pending[1] > 0:
                pending[1] -= 1
                fault = fault or pending[0]
        if fault is not None:
            self.stats.faults += 1
            raise LaneFault(fault, f"injected lane fault {fault}")
        if self._take(self._capacity_faults, site):
            self.stats.faults += 1
            raise CapacityError(f"injected capacity error at {site}")

    # ------------------------------------------------------------ introspection

    def seq_tokens(self, seq: int) -> tuple[int, ...]:
        """The tokens a sequence holds (tests check forward-once with it)."""
        return tuple(self._get(seq).tokens)

    def live_seqs(self) -> list[int]:
        return sorted(self._seqs)

    def reset_stats(self) -> None:
        self.stats = FakeStats()

    # ------------------------------------------------------------ the pool

    def _get(self, seq: int) -> _Seq:
        s = self._seqs.get(seq)
        if s is None:
            raise UnknownSequence(f"no live sequence {seq}")
        return s

    def _blocks_for(self, n: int) -> int:
        return -(-n // self._page)

    def _fits(self, new_blocks: int) -> bool:
        return self._blocks_total == 0 or len(self._rc) + new_blocks <= self._blocks_total

    def _alloc(self) -> int:
        b = self._next_block
        self._next_block += 1
        self._rc[b] = 1
        return b

    def _release(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            left = self._rc[b] - 1
            if left:
                self._rc[b] = left
            else:
                del self._rc[b]

    def _cow_needed(self, s: _Seq) -> bool:
        """Whether the next write lands in a partial block another sequence holds."""
        return len(s.tokens) % self._page != 0 and self._rc[s.blocks[-1]] > 1

    # ------------------------------------------------------------ sequences

    def seq_create(self) -> int:
        self._alive()
        if self.desc.max_seqs and len(self._seqs) >= self.desc.max_seqs:
            raise CapacityError(f"{self.desc.max_seqs} sequences live")
        self._injected("create")
        seq = self._next_seq
        self._next_seq += 1
        self._seqs[seq] = _Seq([], [], [])
        self.stats.creates += 1
        return seq

    def seq_len(self, seq: int) -> int:
        return len(self._get(seq).tokens)

    def seq_free(self, seq: int) -> None:
        self._alive()
        s = self._get(seq)
        self._injected("free")
        del self._seqs[seq]
        self._release(s.blocks)
        self._lane_faults.pop(seq, None)
        self.stats.frees += 1

    def seq_truncate(self, seq: int, n: int) -> None:
        self._alive()
        s = self._get(seq)
        size = len(s.tokens)
        if not 0 <= n <= size:
            raise OutOfBounds(f"truncate to {n} of a sequence of {size}")
        if self.desc.exact_only and n not in (0, size):
            raise OutOfBounds(f"exact_only: truncate only to 0 or {size}, not {n}")
        self._injected("truncate")
        self._truncate_blocks(s, n)
        self.stats.truncates += 1

    def seq_settle(self, seq: int) -> None:
        self._alive()
        s = self._get(seq)
        if s.decoded:
            self._rechain(s, len(s.tokens) - s.decoded)

    def seq_copy(self, src: int, dst: int, n: int) -> None:
        self._alive()
        s, d = self._get(src), self._get(dst)
        size = len(s.tokens)
        if not 0 <= n <= size:
            raise OutOfBounds(f"copy of {n} cells from a sequence of {size}")
        if self.desc.exact_only and n not in (0, size):
            raise OutOfBounds(f"exact_only: copy only a whole sequence ({size}), not {n}")
        self._injected("copy")
        if src == dst:  # dst holds the first n cells of itself: a truncate
            self._truncate_blocks(d, n)
            self.stats.copies += 1
            return
        shared = n // self._page if self.desc.copy_shares_cells else 0
        fresh = self._blocks_for(n) - shared
        # Blocks dst lets go of that nobody else keeps, after it takes src's shared ones.
        delta = collections.Counter(s.blocks[:shared])
        delta.subtract(d.blocks)
        freed = sum(1 for b, k in delta.items() if self._rc[b] + k == 0)
        if not self._fits(fresh - freed):
            raise CapacityError(f"copy of {n} cells needs {fresh} blocks")
        blocks = s.blocks[:shared]
        for b in blocks:
            self._rc[b] += 1
        blocks += [self._alloc() for _ in range(fresh)]
        self._release(d.blocks)
        d.tokens, d.chain, d.blocks = s.tokens[:n], s.chain[:n], blocks
        d.decoded = max(0, n - (size - s.decoded))
        self.stats.copies += 1

    def _truncate_blocks(self, s: _Seq, n: int) -> None:
        keep = self._blocks_for(n)
        self._release(s.blocks[keep:])
        s.decoded = max(0, n - (len(s.tokens) - s.decoded))
        del s.blocks[keep:], s.tokens[n:], s.chain[n:]

    # ------------------------------------------------------------ steps

    def _check_feeds(self, feeds: Sequence[Feed]) -> list[tuple[_Seq, list[int]]]:
        """Every check of a step, before anything moves; the feeds resolved."""
        vocab, limit = self.desc.vocab_size, self.desc.max_seq_len
        seen: set[int] = set()
        out: list[tuple[_Seq, list[int]]] = []
        for f in feeds:
            s = self._get(f.seq)
            if f.seq in seen:
                raise OutOfBounds(f"sequence {f.seq} fed twice in one step")
            seen.add(f.seq)
            try:
                toks = [operator.index(t) for t in f.tokens]
            except TypeError as e:
                raise OutOfBounds(f"sequence {f.seq}: tokens must be ints") from e
            if not toks:
                raise OutOfBounds(f"sequence {f.seq}: an empty feed")
            if min(toks) < 0 or max(toks) >= vocab:
                raise OutOfBounds(f"sequence {f.seq}: a token outside [0, {vocab})")
            if len(s.tokens) + len(toks) > limit:
                raise OutOfBounds(f"sequence {f.seq}: {len(s.tokens)} + {len(toks)} cells > {limit}")
            out.append((s, toks))
        return out

    def _advance(self, feeds: Sequence[Feed]) -> list[tuple[_Seq, int]]:
        """Check, inject, reserve and append: the shared body of every step.
        Returns each feed's sequence and the length it had before."""
        self._alive()
        self.stats.step_calls += 1
        resolved = self._check_feeds(feeds)
        self._injected("step", [f.seq for f in feeds])
        need = 0
        for s, toks in resolved:
            need += self._blocks_for(len(s.tokens) + len(toks)) - len(s.blocks) + self._cow_needed(s)
        if not self._fits(need):
            raise CapacityError(f"step needs {need} more blocks")
        n_tokens = sum(len(t) for _, t in resolved)
        self._spend(self._step_cost + self._token_cost * n_tokens)
        out: list[tuple[_Seq, int]] = []
        modes = self.desc.exact_only
        for (s, toks), f in zip(resolved, feeds):
            start = len(s.tokens)
            if self._cow_needed(s):
                self._release(s.blocks[-1:])
                s.blocks[-1] = self._alloc()
            decode = modes and f.decode and len(toks) == 1
            if modes and not decode and s.decoded:
                self._rechain(s, start - s.decoded)  # prefill redoes what decode fed
            h = s.chain[-1] if s.chain else self._salt
            for t in toks:
                h = (h * _BASE + t + 1) & _M64
                if decode:
                    h ^= _DECODED
                s.chain.append(h)
            s.decoded = s.decoded + 1 if decode else 0
            s.tokens.extend(toks)
            while len(s.blocks) < self._blocks_for(len(s.tokens)):
                s.blocks.append(self._alloc())
            out.append((s, start))
        self.stats.steps += 1
        self.stats.tokens_fed += n_tokens
        return out

    def _rechain(self, s: _Seq, start: int, decoded: int = 0) -> None:
        """s.chain from position `start` on as prefill feeds would make it,
        the last `decoded` positions as decode feeds would."""
        del s.chain[start:]
        h = s.chain[-1] if s.chain else self._salt
        n = len(s.tokens)
        for i in range(start, n):
            h = (h * _BASE + s.tokens[i] + 1) & _M64
            if i >= n - decoded:
                h ^= _DECODED
            s.chain.append(h)
        s.decoded = decoded

    def _row(self, h: int, pos: int) -> np.ndarray:
        """The logits row of the cell whose history hash is h, at position pos.
        Three table rows summed element by element: a fresh array, the same
        bits in any batch."""
        m = _mix64(h ^ self._salt ^ (pos << 40))
        k, t = self._kmask, self._tables
        row = t[0, m & k] + t[1, (m >> 12) & k]
        row += t[2, (m >> 24) & k]
        if (m >> 48) < self._eos_cut:  # ~eos_rate of positions end here
            row[self._eos[(m >> 36) % len(self._eos)]] = row.max() + np.float32(1.0)
        return row

    def step(self, feeds: Sequence[Feed]) -> list[np.ndarray]:
        if not feeds:
            return []
        done = self._advance(feeds)
        rows = [self._row(s.chain[-1], len(s.tokens)) for (s, _), f in zip(done, feeds) if f.wants_row]
        self.stats.rows += len(rows)
        return rows

    def step_rows(self, feeds: Sequence[Feed]) -> list[np.ndarray] | None:
        if not feeds:
            return []
        done = self._advance(feeds)
        out = [np.stack([self._row(s.chain[i], i + 1) for i in range(start, len(s.tokens))])
               for s, start in done]
        self.stats.rows += sum(len(r) for r in out)
        return out

    def step_sampled(self, feeds: Sequence[Feed], specs: Sequence[SampleSpec],
                     masks: TokenMasks | None = None) -> list[int] | None:
        if not self.desc.engine_sampling:
            return None
        if len(specs) != len(feeds):
            raise OutOfBounds(f"{len(specs)} sample specs for {len(feeds)} feeds")
        if not self.desc.engine_draws and any(sp.temperature > 0 for sp in specs):
            raise Unsupported("this fake samples greedily only (engine_draws is off)")
        if not feeds:
            return []
        masks = check_masks(masks, len(feeds), self.desc.vocab_size)
        mask_of = {} if masks is None else dict(zip(masks.rows, masks.bits))
        done = self._advance(feeds)
        out = []
        for i, ((s, _), sp) in enumerate(zip(done, specs)):
            row = self._row(s.chain[-1], len(s.tokens))
            if i in mask_of:
                from superfluid.kernels.reference_sampler import apply_bitmask

                apply_bitmask(row, mask_of[i])
            if sp.temperature > 0 and self._sampling is not None:
                tok = self._sampling.sample(row, sp.temperature, sp.top_k, sp.top_p, sp.min_p,
                                            sp.rng_position)
            else:
                tok = np.argmax(row)  # the lowest id on ties, as contract §5 wants
            out.append(int(tok))
        self.stats.sampled += len(out)
        return out

    def _spend(self, seconds: float) -> None:
        """The simulated cost of a step: a sleep, or a spin a benchmark can subtract."""
        if seconds <= 0:
            return
        ns = int(seconds * 1e9)
        self.stats.simulated_ns += ns
        if self._cost_mode == "sleep":
            time.sleep(seconds)
            return
        end = time.perf_counter_ns() + ns
        while time.perf_counter_ns() < end:
            pass

    # ------------------------------------------------------------ export / import

    def seq_export(self, seq: int) -> bytes:
        self._alive()
        s = self._get(seq)
        self._injected("export")
        body = np.asarray(s.tokens + [s.decoded], dtype="<u4").tobytes()
        self.stats.exports += 1
        return _BLOB.pack(_MAGIC, _VERSION, 0, self._fingerprint, len(s.tokens), zlib.crc32(body)) + body

    def export_bytes_max(self) -> int:
        return _BLOB.size + 4 * (self.desc.max_seq_len + 1)

    def _parse(self, data: bytes) -> tuple[list[int], int]:
        """The tokens of a blob this model exported and how many trailing ones
        decode fed; OutOfBounds on anything else."""
        data = bytes(data)
        if len(data) < _BLOB.size:
            raise OutOfBounds("blob shorter than its header")
        magic, version, flags, fingerprint, n, crc = _BLOB.unpack_from(data)
        if magic != _MAGIC or version != _VERSION or flags != 0:
            raise OutOfBounds("not a fake runtime blob of this version")
        if fingerprint != self._fingerprint:
            raise OutOfBounds("blob exported by another model")
        body = data[_BLOB.size:]
        if len(body) != 4 * (n + 1) or zlib.crc32(body) != crc:
            raise OutOfBounds("blob length or checksum does not match")
        if n > self.desc.max_seq_len:
            raise OutOfBounds(f"blob of {n} cells > max_seq_len")
        toks = np.frombuffer(body, dtype="<u4")
        decoded = int(toks[-1])
        toks = toks[:-1]
        if n and int(toks.max()) >= self.desc.vocab_size:
            raise OutOfBounds("blob holds a token outside the vocabulary")
        if decoded > n:
            raise OutOfBounds(f"blob says {decoded} of its {n} tokens were decoded")
        return toks.tolist(), decoded

    def seq_import(self, seq: int, data: bytes) -> int:
        self._alive()
        s = self._get(seq)
        if s.tokens:
            raise OutOfBounds(f"import into sequence {seq}, which holds {len(s.tokens)} cells")
        toks, decoded = self._parse(data)
        self._injected("import")
        if not self._fits(self._blocks_for(len(toks))):
            raise CapacityError(f"import of {len(toks)} cells")
        s.tokens = toks
        self._rechain(s, 0, decoded)
        s.blocks = [self._alloc() for _ in range(self._blocks_for(len(toks)))]
        self.stats.imports += 1
        return len(toks)

    # ------------------------------------------------------------ counters

    def cell_bytes(self) -> int:
        return self._bytes_per_cell

    def mem_counters(self) -> MemCounters:
        used = len(self._rc) * self._page
        return MemCounters(self._blocks_total * self._page, used, used * self._bytes_per_cell, len(self._seqs))

    def cells_released(self, seqs: Sequence[int]) -> int:
        holders: collections.Counter[int] = collections.Counter()
        for seq in set(seqs):
            holders.update(self._get(seq).blocks)
        return self._page * sum(1 for b, k in holders.items() if k == self._rc[b])

    def vocabulary(self) -> Vocabulary:
        specials = {"<eos>": self._eos[0]}
        specials.update({f"<eos{i}>": e for i, e in enumerate(self._eos[1:], 1)})
        return Vocabulary(self.desc.vocab_size, self._eos_set, specials)

    def is_eos(self, token: int) -> bool:
        return token in self._eos_set

    def close(self) -> None:
        self._seqs.clear()
        self._rc.clear()
        self._closed = True

    def __repr__(self) -> str:
        m = self.mem_counters()
        return f"FakeRuntime(seqs={m.seqs}, cells={m.cells_used}/{m.cells_total or 'inf'}, {self.desc})"
