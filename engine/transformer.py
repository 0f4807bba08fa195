"""The paged-KV transformer runtime (contract §8) over Model and KVPool.

Sequences are block tables in the pool. A step is checked whole before
anything moves (known sequences, each once, tokens in the vocabulary, room
under max_seq_len, free blocks for every feed), then blocks are taken, the
forward pass runs, and lengths advance. If the forward pass itself fails the
block tables and lengths are put back, so a failed step changed nothing the
executor can see.
"""

from __future__ import annotations

import operator
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from superfluid.engine.config import ModelConfig
from superfluid.engine.kv import SeqState
from superfluid.engine.kv_mirrors import DecodeMirrors
from superfluid.engine.model import Model
from superfluid.engine.runtime import (
    NONFINITE,
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
    Vocabulary,
    check_masks,
)
from superfluid.kernels.cpu_step import step_layout

_EXPORT_MAGIC, _EXPORT_VERSION = b"SFKV", 2
# magic, version, cells, layers, kv_heads, head_dim, dtype, page, crc32 (of the header with this field
# zero, then the payload), the numeric class the cells were computed in (v2: a worker of another
# class would not continue them bitwise)
_EXPORT_HEAD = struct.Struct("<4sIIIIIIII64s")


DEFAULT_KV_CELLS, DEFAULT_PAGE, DEFAULT_MAX_BATCH = 16384, 16, 64


class TransformerRuntime(Runtime):
    """A Llama-family model serving ragged steps over a paged KV pool."""

    def __init__(self, model: Model, *, kv_cells: int = DEFAULT_KV_CELLS, page: int = DEFAULT_PAGE,
                 max_batch: int = DEFAULT_MAX_BATCH,
                 max_seqs: int = 0, prefill_step_tokens: int = 512, specials: dict[str, int] | None = None,
                 runtime_id: str | None = None, tokenizer_json: str | None = None):
        cfg: ModelConfig = model.cfg
        self.model = model
        self.cfg = cfg
        self.pool = model.kv_pool(-(-kv_cells // page) + 1, page)
        self.seqs: dict[int, SeqState] = {}
        self._next_id = 1
        self.desc = RuntimeDescription(
            runtime_id=runtime_id or f"{cfg.arch}-{model.backend.name}",
            vocab_size=cfg.vocab_size, max_seq_len=model.max_seq_len, max_batch=max_batch, max_seqs=max_seqs,
            page=page, truncate_partial=True, copy_shares_cells=True, takeover_preferred=False,
            prefill_step_tokens=prefill_step_tokens, engine_sampling=True, engine_draws=True,
            verify_batches=True, exact_only=False,
            numeric_class=model.numeric_class, isa=model.backend.isa(model.device))
        self._vocab = Vocabulary(cfg.vocab_size, frozenset(cfg.eos_token_ids), dict(specials or {}))
        self._tokenizer_json = tokenizer_json  # for grammars; None: none
        backend = model.backend
        # Mirrors take at most twice what the pool takes, so the memory a worker
        # uses stays a known multiple of --kv-cells.
        self._mirrors = (DecodeMirrors(2 * self.pool.allocated_bytes) if backend.dense_kv and self.pool.heads_major
                         else None)

    # --------------------------------------------------------- sequences

    def _seq(self, seq: int) -> SeqState:
        s = self.seqs.get(seq)
        if s is None:
            raise UnknownSequence(f"no sequence {seq}")
        return s

    def seq_create(self) -> int:
        if self.desc.max_seqs and len(self.seqs) >= self.desc.max_seqs:
            raise CapacityError(f"{len(self.seqs)} sequences live, max_seqs is {self.desc.max_seqs}")
        sid = self._next_id
        self._next_id += 1
        self.seqs[sid] = SeqState(blocks=[])
        return sid

    def seq_copy(self, src: int, dst: int, n: int) -> None:
        s, d = self._seq(src), self._seq(dst)
        n = _count(n, "copy")
        if not 0 <= n <= s.length:
            raise OutOfBounds(f"copy of {n} cells from a sequence of {s.length}")
        if src == dst:
            self.seq_truncate(src, n)
            return
        partial = 1 if n % self.pool.page else 0
        # dst's own blocks come back first, so a full pool can still copy.
        if partial > self.pool.n_free + self.pool.released_by([d]):
            raise CapacityError("no free block for the copied partial block")
        self.pool.release(d)
        copied = self.pool.copy_prefix(s, n)
        copied.version = d.version + 1
        self.seqs[dst] = copied

    def seq_truncate(self, seq: int, n: int) -> None:
        s = self._seq(seq)
        n = _count(n, "truncate")
        if not 0 <= n <= s.length:
            raise OutOfBounds(f"truncate to {n} cells of a sequence of {s.length}")
        self.pool.truncate(s, n)

    def seq_free(self, seq: int) -> None:
        s = self.seqs.pop(seq, None)
        if s is None:
            raise UnknownSequence(f"no sequence {seq}")
        self.pool.release(s)
        if self._mirrors:
            self._mirrors.forget(seq)

    def seq_len(self, seq: int) -> int:
        return self._seq(seq).length

    # -------------------------------------------------------------- steps

    def _check(self, feeds: Sequence[Feed]) -> list[SeqState]:
        if len(feeds) > self.desc.max_batch:
            raise OutOfBounds(f"{len(feeds)} feeds in one step, max_batch is {self.desc.max_batch}")
        states, seen, need = [], set(), 0
        cow: dict[int, int] = {}  # shared partial block -> holders fed in this step
        vocab = self.cfg.vocab_size
        for f in feeds:
            s = self._seq(f.seq)
            if f.seq in seen:
                raise OutOfBounds(f"sequence {f.seq} fed twice in one step")
            seen.add(f.seq)
            if not f.tokens:
                raise OutOfBounds(f"an empty feed for sequence {f.seq}")
            if not all(type(t) is int for t in f.tokens):
                try:
                    f = Feed(f.seq, [operator.index(t) for t in f.tokens], f.wants_row)
                except TypeError:
                    raise OutOfBounds(f"a token of sequence {f.seq} is not an integer") from None
            if min(f.tokens) < 0 or max(f.tokens) >= vocab:
                raise OutOfBounds(f"a token of sequence {f.seq} is outside the vocabulary of {vocab}")
            if s.length + len(f.tokens) > self.desc.max_seq_len:
                raise OutOfBounds(f"sequence {f.seq} would hold {s.length + len(f.tokens)} cells, "
                                  f"max_seq_len is {self.desc.max_seq_len}")
            need += self.pool.grow_cost(s, len(f.tokens))
            if (b := self.pool.cow_block(s)) is not None:
                cow[b] = cow.get(b, 0) + 1
            states.append(s)
        # The last holder of a shared partial block writes it in place: of h holders
        # fed together, only min(h, refs - 1) copy it.
        need -= sum(h - min(h, self.pool.refs[b] - 1) for b, h in cow.items())
        if need > self.pool.n_free:
            raise CapacityError(f"the step needs {need} KV blocks, {self.pool.n_free} are free")
        return states

    def _forward(self, feeds: Sequence[Feed], all_rows: bool, picks: list[Any] | None = None) -> torch.Tensor:
        """Logits of the wanted rows (every token's with all_rows), feed order;
        `picks` as Model.forward's."""
        states = self._check(feeds)
        saved = [(list(s.blocks), s.length) for s in states]
        dev = self.model.device
        try:
            for s, f in zip(states, feeds):
                self.pool.grow(s, len(f.tokens))
            layout = [(s.blocks, s.length, len(f.tokens)) for s, f in zip(states, feeds)]
            ids = [t for f in feeds for t in f.tokens]
            tokens: torch.Tensor | None = None
            if getattr(self.model, "takes_ids", False):  # the CPU stack: ids in the layout, no tensor
                batch = step_layout(layout, self.pool.page, ids)
            else:
                q_per_kv = self.cfg.num_heads // self.cfg.num_kv_heads
                batch = self.model.backend.layout(layout, self.pool.page, q_per_kv, dev)
                tokens = torch.tensor(ids, dtype=torch.long, device=dev)
            mirrored = self._mirrors.attach(self.pool, batch, feeds, states) if self._mirrors else []
            row_index = None
            if not all_rows and not all(len(f.tokens) == 1 and f.wants_row for f in feeds):  # else: every row
                ends = np.cumsum([len(f.tokens) for f in feeds]) - 1
                row_index = torch.tensor([int(e) for e, f in zip(ends, feeds) if f.wants_row], dtype=torch.long,
                                         device=dev)
            logits = self.model.forward(tokens, batch, self.pool.k, self.pool.v, row_index, picks)
            if self.nan_rows:
                _poison(logits, feeds, all_rows, self.nan_rows)
                if picks:
                    picks.clear()  # taken before the poison: the caller picks from the rows
        except torch.cuda.OutOfMemoryError as e:
            self._restore(states, saved)
            raise CapacityError(f"device memory: {e}") from e
        except (CapacityError, LaneFault):
            self._restore(states, saved)
            raise
        except Exception as e:
            self._restore(states, saved)
            raise FatalError(f"forward pass failed: {e!r}") from e
        for s, f in zip(states, feeds):
            s.length += len(f.tokens)
        for m in mirrored:
            m.lengths = [n + 1 for n in m.lengths]
        return logits

    def _restore(self, states: list[SeqState], saved: list[tuple[list[int], int]]) -> None:
        for s, (blocks, length) in zip(states, saved):
            fresh = [b for b in s.blocks if b not in blocks]
            self.pool.decref(fresh)
            # A copy-on-write moved a shared block: take the original back.
            for i, b in enumerate(blocks):
                if i < len(s.blocks) and s.blocks[i] != b:
                    self.pool.incref([b])
            s.blocks, s.length = blocks, length

    def step(self, feeds: Sequence[Feed]) -> list[np.ndarray]:
        if not feeds:
            return []
        out = self._forward(feeds, all_rows=False)
        out = out.cpu().numpy()
        return [out[i] for i in range(out.shape[0])]

    def step_rows(self, feeds: Sequence[Feed]) -> list[np.ndarray]:
        if not feeds:
            return []
        out = self._forward(feeds, all_rows=True)
        out = out.cpu().numpy()
        res, at = [], 0
        for f in feeds:
            res.append(out[at:at + len(f.tokens)])
            at += len(f.tokens)
        return res

    def step_sampled(self, feeds: Sequence[Feed], specs: Sequence[SampleSpec],
                     masks: TokenMasks | None = None) -> list[int]:
        if len(specs) != len(feeds):
            raise OutOfBounds(f"{len(specs)} sample specs for {len(feeds)} feeds")
        if not feeds:
            return []
        _check_specs(specs)  # before the step: a bad spec must change nothing
        masks = check_masks(masks, len(feeds), self.cfg.vocab_size)
        feeds = [f if f.wants_row else Feed(f.seq, f.tokens, True) for f in feeds]
        greedy = getattr(self.model.backend, "greedy", None)
        if greedy is not None and masks is None and not any(s.temperature > 0 for s in specs):
            # Every row greedy, no mask (most decode steps): one pass in C, not ~15 torch ops (the
            # CPU stack's own call makes it on the way)
            picks: list[Any] = []
            logits = self._forward(feeds, all_rows=False, picks=picks)
            picked, nonfinite = picks if picks else greedy(logits)
            return [NONFINITE if b else t for t, b in zip(picked, nonfinite)]
        logits = self._forward(feeds, all_rows=False)
        bad = ~torch.isfinite(logits.amax(1))  # a NaN or +inf is the max; so is -inf when nothing else is left
        toks: list[int] = self.model.backend.sample(logits, specs, masks, consume=True).tolist()
        if bool(bad.any()):
            for i in bad.nonzero().flatten().tolist():
                toks[i] = NONFINITE
        return toks

    @property
    def tokenizer_json(self) -> str | None:
        return self._tokenizer_json

    # ---------------------------------------------------- export / import

    def seq_export(self, seq: int) -> bytes:
        s = self._seq(seq)
        k, v = self.pool.read_cells(s) if s.length else (torch.empty(0), torch.empty(0))
        dt = 0 if self.pool.k.dtype == torch.float32 else (1 if self.pool.k.dtype == torch.bfloat16 else 2)
        payload = _tensor_bytes(k) + _tensor_bytes(v)
        fields = [_EXPORT_MAGIC, _EXPORT_VERSION, s.length, self.cfg.num_layers, self.cfg.num_kv_heads,
                  self.cfg.head_dim, dt, self.pool.page, 0, self.desc.numeric_class.encode()]
        fields[8] = zlib.crc32(payload, zlib.crc32(_EXPORT_HEAD.pack(*fields)))
        return _EXPORT_HEAD.pack(*fields) + payload

    def seq_import(self, seq: int, data: bytes) -> int:
        s = self._seq(seq)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise OutOfBounds(f"an export blob must be bytes, not {type(data).__name__}")
        if s.length:
            raise OutOfBounds(f"import into sequence {seq}, which holds {s.length} cells")
        if len(data) < _EXPORT_HEAD.size:
            raise OutOfBounds("an export blob shorter than its header")
        magic, version, n, layers, kvh, hd, dt, _page, crc, numeric = _EXPORT_HEAD.unpack_from(data)
        want = (self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim)
        if magic != _EXPORT_MAGIC or version != _EXPORT_VERSION or (layers, kvh, hd) != want:
            raise OutOfBounds(f"an export blob of another model or format ({magic!r} v{version}, "
                              f"{layers}x{kvh}x{hd}, expected v{_EXPORT_VERSION} {want[0]}x{want[1]}x{want[2]})")
        dtype = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16}.get(dt)
        if dtype is None:
            raise OutOfBounds(f"an export blob of unknown dtype {dt}")
        if n > self.desc.max_seq_len:
            raise OutOfBounds(f"an export of {n} cells, max_seq_len is {self.desc.max_seq_len}")
        each = n * layers * kvh * hd * torch.tensor([], dtype=dtype).element_size()
        if len(data) != _EXPORT_HEAD.size + 2 * each:
            raise OutOfBounds(f"an export blob of {len(data)} bytes, expected {_EXPORT_HEAD.size + 2 * each}")
        head0 = _EXPORT_HEAD.pack(magic, version, n, layers, kvh, hd, dt, _page, 0, numeric)
        if zlib.crc32(memoryview(data)[_EXPORT_HEAD.size:], zlib.crc32(head0)) != crc:
            raise OutOfBounds("an export blob whose checksum does not match (corrupted)")
        theirs = numeric.rstrip(b"\0").decode("ascii", "replace")
        if theirs != self.desc.numeric_class:
            raise OutOfBounds(f"an export blob of numeric class {theirs!r}; this worker computes "
                              f"{self.desc.numeric_class!r}, so its rows would not continue the blob's bitwise")
        if n == 0:
            return 0
        need = self.pool.blocks_for(n)
        if need > self.pool.n_free:
            raise CapacityError(f"the import needs {need} KV blocks, {self.pool.n_free} are free")
        shape = (layers, n, kvh, hd)
        k = _bytes_tensor(data[_EXPORT_HEAD.size:_EXPORT_HEAD.size + each], dtype, shape)
        v = _bytes_tensor(data[_EXPORT_HEAD.size + each:], dtype, shape)
        if not (bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())):
            raise OutOfBounds("an export blob holding non-finite keys or values")
        s.blocks = self.pool.alloc(need)
        s.length = n
        s.version += 1
        self.pool.write_cells(s, 0, k, v)
        return n

    # ----------------------------------------------------------- counters

    def mem_counters(self) -> MemCounters:
        p = self.pool
        assert p.n_blocks is not None  # a KV pool always has a size
        mirrors = self._mirrors.bytes if self._mirrors else 0
        return MemCounters((p.n_blocks - 1) * p.page, p.n_used * p.page,
                           p.allocated_bytes + self.model.weight_bytes + mirrors, len(self.seqs))

    def cell_bytes(self) -> int:
        return self.pool.bytes_per_block // self.pool.page

    def cells_released(self, seqs: Sequence[int]) -> int:
        states = [self._seq(s) for s in dict.fromkeys(seqs)]
        return self.pool.released_by(states) * self.pool.page

    def vocabulary(self) -> Vocabulary:
        return self._vocab

    def is_eos(self, token: int) -> bool:
        return token in self._vocab.eos

    def idle(self) -> None:
        self.model.backend.idle()

    def close(self) -> None:
        self.seqs.clear()
        self.model.close()
        if self._mirrors:
            self._mirrors.entries.clear()


def _count(n: Any, what: str) -> int:
    try:
        return operator.index(n)
    except TypeError:
        raise OutOfBounds(f"{what}: a cell count must be an integer, not {type(n).__name__}") from None


def _check_specs(specs: Sequence[SampleSpec]) -> None:
    for i, sp in enumerate(specs):
        try:
            for name in ("temperature", "top_p", "min_p"):
                float(getattr(sp, name))
            k, pos = operator.index(sp.top_k), operator.index(sp.rng_position)
        except (TypeError, ValueError, AttributeError) as e:
            raise OutOfBounds(f"sample spec {i}: {e}") from None
        if not 0 <= k < 1 << 63:
            raise OutOfBounds(f"sample spec {i}: top_k {k} outside [0, 2^63)")
        if not 0 <= pos < 1 << 64:
            raise OutOfBounds(f"sample spec {i}: rng_position {pos} outside [0, 2^64)")


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.float32 else t.numpy().tobytes()


def _bytes_tensor(b: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8).view(dtype).reshape(shape)



def _poison(logits: torch.Tensor, feeds: Sequence[Feed], all_rows: bool, seqs: frozenset[int]) -> None:
    """Fault injection: the rows of these sequences' feeds become NaN."""
    with torch.inference_mode():  # (the forward pass made them inference tensors)
        _poison_rows(logits, feeds, all_rows, seqs)


def _poison_rows(logits: torch.Tensor, feeds: Sequence[Feed], all_rows: bool, seqs: frozenset[int]) -> None:
    at = 0
    for f in feeds:
        n = len(f.tokens) if all_rows else int(f.wants_row)
        if f.seq in seqs and n:
            logits[at:at + n] = float("nan")
        at += n
