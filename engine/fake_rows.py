"""The fake runtime's model: a sequence's history, the logits row of each of its
cells, and its export blob.

The row of a token is a pure function of its sequence's history up to and
including it: a polynomial hash chained over the history, mixed, picks three
rows of fixed random tables that are summed in float32. Nothing else in a
step touches it, so batch invariance and chunking invariance hold bitwise by
construction, and greedy decoding does not loop (every position hashes
differently). An exact_only decode feed mixes a constant into its position's
hash (engine/fake.py says why).
"""

from __future__ import annotations

import dataclasses
import functools
import struct
import zlib

import numpy as np

from superfluid.engine.runtime import OutOfBounds

_M64 = (1 << 64) - 1
_BASE = 0x9E3779B97F4A7C15 | 1  # odd, so the chain is a bijection per token
_DECODED = 0xD1B54A32D192ED03  # an exact_only decode feed's position: mixed in

# Export blob: magic, version, flags (0), model fingerprint, tokens, crc32 of the body:
# the tokens, then (u32) how many trailing ones decode fed (exact_only).
_BLOB = struct.Struct("<4sHHQII")
_MAGIC = b"SFFK"
_VERSION = 2


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
    is told to (see FakeModel.row), yet keeps some mass for sampling."""
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


@dataclasses.dataclass
class FakeSeq:
    tokens: list[int]
    chain: list[int]  # the history hash after each token
    blocks: list[int]  # pool blocks holding the cells: ceil(len / page)
    decoded: int = 0  # exact_only: trailing tokens fed by decode feeds since the last prefill

    @property
    def length(self) -> int:
        return len(self.tokens)


class FakeModel:
    """The rows of one seed, vocabulary and EOS set."""

    def __init__(self, seed: int, vocab_size: int, eos: tuple[int, ...], eos_rate: float):
        self.vocab_size = vocab_size
        self._eos = eos
        self._eos_cut = round(eos_rate * 65536)
        self._tables = _tables(seed & _M64, vocab_size, eos)
        self._kmask = self._tables.shape[1] - 1
        self.salt = _mix64((seed & _M64) ^ 0x5F0F)  # the hash of an empty history
        # What the rows depend on: a blob from a runtime with other rows is refused.
        fp = self.salt
        for x in (vocab_size, self._eos_cut, *eos):
            fp = _mix64(fp ^ x)
        self.fingerprint = fp

    def append(self, s: FakeSeq, tokens: list[int], decode: bool) -> None:
        """tokens fed to s (by a decode feed: `decode`), their hashes chained."""
        h = s.chain[-1] if s.chain else self.salt
        for t in tokens:
            h = (h * _BASE + t + 1) & _M64
            if decode:
                h ^= _DECODED
            s.chain.append(h)
        s.decoded = s.decoded + 1 if decode else 0
        s.tokens.extend(tokens)

    def rechain(self, s: FakeSeq, start: int, decoded: int = 0) -> None:
        """s.chain from position `start` on as prefill feeds would make it,
        the last `decoded` positions as decode feeds would."""
        del s.chain[start:]
        h = s.chain[-1] if s.chain else self.salt
        n = len(s.tokens)
        for i in range(start, n):
            h = (h * _BASE + s.tokens[i] + 1) & _M64
            if i >= n - decoded:
                h ^= _DECODED
            s.chain.append(h)
        s.decoded = decoded

    def row(self, h: int, pos: int) -> np.ndarray:
        """The logits row of the cell whose history hash is h, at position pos.
        Three table rows summed element by element: a fresh array, the same
        bits in any batch."""
        m = _mix64(h ^ self.salt ^ (pos << 40))
        k, t = self._kmask, self._tables
        row = t[0, m & k] + t[1, (m >> 12) & k]
        row += t[2, (m >> 24) & k]
        if (m >> 48) < self._eos_cut:  # ~eos_rate of positions end here
            row[self._eos[(m >> 36) % len(self._eos)]] = row.max() + np.float32(1.0)
        return row

    # ------------------------------------------------------------ blobs

    def pack(self, tokens: list[int], decoded: int) -> bytes:
        body = np.asarray(tokens + [decoded], dtype="<u4").tobytes()
        return _BLOB.pack(_MAGIC, _VERSION, 0, self.fingerprint, len(tokens), zlib.crc32(body)) + body

    @staticmethod
    def blob_bytes_max(max_seq_len: int) -> int:
        return _BLOB.size + 4 * (max_seq_len + 1)

    def parse(self, data: bytes, max_seq_len: int) -> tuple[list[int], int]:
        """The tokens of a blob this model exported and how many trailing ones
        decode fed; OutOfBounds on anything else."""
        data = bytes(data)
        if len(data) < _BLOB.size:
            raise OutOfBounds("blob shorter than its header")
        magic, version, flags, fingerprint, n, crc = _BLOB.unpack_from(data)
        if magic != _MAGIC or version != _VERSION or flags != 0:
            raise OutOfBounds("not a fake runtime blob of this version")
        if fingerprint != self.fingerprint:
            raise OutOfBounds("blob exported by another model")
        body = data[_BLOB.size:]
        if len(body) != 4 * (n + 1) or zlib.crc32(body) != crc:
            raise OutOfBounds("blob length or checksum does not match")
        if n > max_seq_len:
            raise OutOfBounds(f"blob of {n} cells > max_seq_len")
        toks = np.frombuffer(body, dtype="<u4")
        decoded = int(toks[-1])
        toks = toks[:-1]
        if n and int(toks.max()) >= self.vocab_size:
            raise OutOfBounds("blob holds a token outside the vocabulary")
        if decoded > n:
            raise OutOfBounds(f"blob says {decoded} of its {n} tokens were decoded")
        return toks.tolist(), decoded
