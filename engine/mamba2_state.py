"""Mamba2 sequence state: a pool of fixed-size slots and each sequence's place in it.

A sequence's state is one slot holding, per layer, two states:
- canonical: the state at the sequence's last chunk boundary `b` (a multiple
  of the chunk length L): the K-1 conv inputs before b and the SSM state at b.
  It is a pure function of the tokens before b, computed only by whole
  fixed-shape chunks, so it is bitwise what a fresh prefill of those tokens
  would hold at b (the runtime's batch and chunking invariance rests on it);
- live: the state after the sequence's last token, which decode feeds update.
  `live_valid` is False after a truncate below the length (rebuilt from b).
The tokens since b (fewer than L) are kept too: a prefill recomputes the
partial chunk from b with them.

The blob format (seq_export) carries all of it: magic, version, a model
fingerprint (shapes, chunk length, a digest of the SSM parameters), lengths,
flags, a crc32 of the payload, then the tokens since b and the four states.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib

import numpy as np
import torch

from superfluid.engine.blocks import BlockPool
from superfluid.engine.mamba2 import Mamba2Config
from superfluid.engine.runtime import CapacityError, OutOfBounds

_MAGIC = b"SFM2"
_VERSION = 1
# magic, version, fingerprint, length, boundary, tokens since the boundary, flags (bit 0: live valid), crc32
_HEAD = struct.Struct("<4sIQIIIII")
_LIVE_VALID = 1


@dataclasses.dataclass
class SeqState:
    slot: int
    boundary: int = 0                                  # b: a multiple of the chunk length
    since: list[int] = dataclasses.field(default_factory=list)  # tokens after b
    live_valid: bool = True                            # an empty sequence's live state is the zero state

    @property
    def length(self) -> int:
        return self.boundary + len(self.since)


class StatePool:
    """`slots` fixed-size states on one device, layer-major: slot i of layer l
    is canon_*[l, i] and live_*[l, i] (a step gathers and writes one layer's
    rows of many slots at a time)."""

    def __init__(self, cfg: Mamba2Config, slots: int, device: torch.device):
        if slots < 1:
            raise ValueError(f"a state pool needs at least one slot (got {slots})")
        L, K = cfg.num_layers, cfg.conv_kernel
        conv = (L, slots, K - 1, cfg.conv_dim)
        ssm = (L, slots, cfg.num_heads, cfg.head_dim, cfg.state_size)
        z = dict(dtype=torch.float32, device=device)
        self.canon_conv, self.live_conv = torch.zeros(conv, **z), torch.zeros(conv, **z)
        self.canon_ssm, self.live_ssm = torch.zeros(ssm, **z), torch.zeros(ssm, **z)
        self.slots = slots
        self._slots = BlockPool(slots, trash=False, what="state slots")  # one holder a slot: no sharing

    @staticmethod
    def slot_bytes(cfg: Mamba2Config) -> int:
        per_layer = (cfg.conv_kernel - 1) * cfg.conv_dim + cfg.num_heads * cfg.head_dim * cfg.state_size
        return 2 * cfg.num_layers * per_layer * 4  # canonical + live, fp32

    @property
    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return self.canon_conv, self.canon_ssm, self.live_conv, self.live_ssm

    def take(self) -> int:
        if not self._slots.fits(1):
            raise CapacityError(f"all {self.slots} state slots are in use")
        (slot,) = self._slots.alloc(1)
        self.reset(slot)
        return slot

    def give_back(self, slot: int) -> None:
        self._slots.decref([slot])

    def reset(self, slot: int) -> None:
        for t in self._tensors():
            t[:, slot].zero_()

    def copy(self, src: int, dst: int) -> None:
        for t in self._tensors():
            t[:, dst].copy_(t[:, src])

    def write(self, pool: torch.Tensor, slots: torch.Tensor, src: torch.Tensor,
              rows: torch.Tensor | None) -> None:
        """pool[l, slots[i]] = src[l, rows[i]] for every layer (rows None: src's rows in order)."""
        for l in range(pool.shape[0]):
            pool[l].index_copy_(0, slots, src[l] if rows is None else src[l].index_select(0, rows))

    # ------------------------------------------------------------ blobs

    def export(self, s: SeqState, fingerprint: int) -> bytes:
        parts = [np.asarray(s.since, dtype="<u4").tobytes()]
        parts += [t[:, s.slot].contiguous().cpu().numpy().astype("<f4", copy=False).tobytes()
                  for t in self._tensors()]
        payload = b"".join(parts)
        head = _HEAD.pack(_MAGIC, _VERSION, fingerprint, s.length, s.boundary, len(s.since),
                          _LIVE_VALID if s.live_valid else 0, zlib.crc32(payload))
        return head + payload

    def export_bytes_max(self, chunk: int) -> int:
        """An export's size with the most tokens since its boundary (chunk - 1)."""
        return _HEAD.size + 4 * (chunk - 1) + sum(t[:, 0].numel() * 4 for t in self._tensors())

    def parse(self, data, fingerprint: int, chunk: int, vocab: int, max_len: int
              ) -> tuple[int, list[int], bool, list[torch.Tensor]]:
        """A blob this model exported: (boundary, tokens since, live valid, the four states).
        OutOfBounds on anything else; nothing is written."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise OutOfBounds(f"an export blob must be bytes, not {type(data).__name__}")
        data = bytes(data)
        if len(data) < _HEAD.size:
            raise OutOfBounds("an export blob shorter than its header")
        magic, version, fp, length, boundary, n_since, flags, crc = _HEAD.unpack_from(data)
        if magic != _MAGIC or version != _VERSION or flags & ~_LIVE_VALID:
            raise OutOfBounds(f"not a Mamba2 state blob of version {_VERSION} ({magic!r} v{version})")
        if fp != fingerprint:
            raise OutOfBounds("a state blob of another model (its fingerprint differs)")
        if boundary % chunk or n_since >= chunk or length != boundary + n_since:
            raise OutOfBounds(f"a state blob with inconsistent lengths (length {length}, boundary "
                              f"{boundary}, {n_since} tokens since; chunk {chunk})")
        if length > max_len:
            raise OutOfBounds(f"a state blob of {length} tokens, max_seq_len is {max_len}")
        shapes = [(t.shape[0], *t.shape[2:]) for t in self._tensors()]
        sizes = [4 * n_since] + [4 * int(np.prod(sh)) for sh in shapes]
        if len(data) != _HEAD.size + sum(sizes):
            raise OutOfBounds(f"a state blob of {len(data)} bytes, expected {_HEAD.size + sum(sizes)}")
        body = memoryview(data)[_HEAD.size:]
        if zlib.crc32(body) != crc:
            raise OutOfBounds("a state blob whose checksum does not match (corrupted)")
        since = np.frombuffer(body[:sizes[0]], dtype="<u4").astype(np.int64)
        if n_since and int(since.max()) >= vocab:
            raise OutOfBounds("a state blob holding a token outside the vocabulary")
        states, at = [], sizes[0]
        for sh, size in zip(shapes, sizes[1:]):
            arr = np.frombuffer(body[at:at + size], dtype="<f4").reshape(sh)
            at += size
            if not np.isfinite(arr).all():
                raise OutOfBounds("a state blob holding non-finite state")
            states.append(torch.from_numpy(arr.copy()).to(self.canon_conv.device))
        return boundary, since.tolist(), bool(flags & _LIVE_VALID), states

    def load(self, slot: int, states: list[torch.Tensor]) -> None:
        for t, v in zip(self._tensors(), states):
            t[:, slot].copy_(v)


def fingerprint(cfg: Mamba2Config, chunk: int, weights: dict[str, torch.Tensor]) -> int:
    """What a state's meaning depends on: the shapes, the chunk length (the
    canonical state is cut at its multiples) and a digest of the SSM parameters."""
    dims = (cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.state_size, cfg.n_groups, cfg.conv_dim,
            cfg.conv_kernel, cfg.vocab_size, chunk)
    crc = zlib.crc32(struct.pack(f"<{len(dims)}I", *dims))
    for l in range(cfg.num_layers):
        for name in ("A_log", "dt_bias", "D"):
            t = weights[f"backbone.layers.{l}.mixer.{name}"]
            crc = zlib.crc32(t.detach().float().cpu().numpy().astype("<f4").tobytes(), crc)
    return (crc << 32) | zlib.crc32(repr(dims).encode())
