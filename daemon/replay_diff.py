"""What a replay compares (docs/recorder.md#what-is-compared): a replayed
outcome against the recorded one, field by field, naming the first field
that differs by its path in the record ("emits[3].tokens[5]").

Left out, because a wall clock decides them and no tick reads them back:
TickEvents.timings, and REGISTER_GRAMMAR's completion value (the compile
time in microseconds). Everything else is compared, bit for bit: admit
results, emits and the tokens each wrote to the token ring, the digest of
each logits row written for a HOST lane, faults, the shed report, op
completions (a msgpack payload key by key), logprobs, the message, the
memory record, the epoch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from superfluid.abi import OpKind, OpStatus
from superfluid.abi.records import LaneEmit, OpCompletion, TickEvents

_SHOW = 160  # characters of a value a report quotes


@dataclass
class Writes:
    """What a call wrote to the rings: the token ring's elements from
    position `start` on (None: more than the ring holds), and a digest of
    each logits row by its reference."""

    capacity: int = 1
    start: int = 0
    tokens: bytes | None = b""
    logits: dict[tuple[int, ...], bytes] = field(default_factory=dict)

    @classmethod
    def recorded(cls, capacity: int, tokens: list, logits: list) -> Writes:
        return cls(capacity, tokens[0], tokens[1], {tuple(r): b for r, b in logits})

    def tokens_at(self, ref: tuple[int, ...]) -> bytes | None:
        """The elements a token-ring reference (ring, generation, offset, len) names."""
        if self.tokens is None:
            return None
        i = ref[1] * self.capacity + ref[2] - self.start
        if i < 0 or (i + ref[3]) * 4 > len(self.tokens):
            return None
        return self.tokens[i * 4:(i + ref[3]) * 4]


def _plain(v: Any) -> Any:
    """A value as the record holds it once read back (tuples are lists)."""
    return msgpack.unpackb(msgpack.packb(v, use_bin_type=True), raw=False, strict_map_key=False)


def show(v: Any) -> str:
    if isinstance(v, bytes):
        try:
            text = repr(v.decode())
        except UnicodeDecodeError:
            text = v.hex()
    else:
        text = repr(v)
    return text if len(text) <= _SHOW else text[:_SHOW - 3] + "..."


Found = tuple[str, Any, Any]  # (field path, recorded, replayed)


def _skipped(obj: Any, name: str) -> bool:
    if name == "timings" and isinstance(obj, TickEvents):
        return True
    return (name == "value" and isinstance(obj, OpCompletion) and obj.op == OpKind.REGISTER_GRAMMAR
            and obj.status == OpStatus.OK)


def _payload(rec: Any, obj: bytes, path: str) -> Found | None:
    """An op payload: key by key where both are msgpack maps."""
    try:
        a = msgpack.unpackb(rec, raw=False, strict_map_key=False)
        b = msgpack.unpackb(obj, raw=False, strict_map_key=False)
    except Exception:
        return (path, rec, obj)
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=repr):
            if a.get(k) != b.get(k):
                return (f"{path}.{k}", a.get(k), b.get(k))
    return (path, a, b)


class Walk:
    def __init__(self, rec_writes: Writes, rep_writes: Writes):
        self.rec, self.rep = rec_writes, rep_writes

    def walk(self, rec: Any, obj: Any, path: str) -> Found | None:
        names = getattr(type(obj), "_fields", None)
        if names is not None:  # a record
            if not isinstance(rec, list) or len(rec) != len(names):
                return (path, rec, _plain(obj))
            for name, r, o in zip(names, rec, obj):
                if _skipped(obj, name):
                    continue
                found = self.walk(r, o, f"{path}.{name}" if path else name)
                if found:
                    return found
            return self._emit(obj, path) if isinstance(obj, LaneEmit) else None
        if isinstance(obj, (tuple, list)):
            if not isinstance(rec, list):
                return (path, rec, _plain(obj))
            for i, (r, o) in enumerate(zip(rec, obj)):
                found = self.walk(r, o, f"{path}[{i}]")
                if found:
                    return found
            if len(rec) != len(obj):
                return (f"{path} (entries)", len(rec), len(obj))
            return None
        if isinstance(obj, bytes) and path.endswith(".payload") and rec != obj:
            return _payload(rec, obj, path)
        p = _plain(obj)
        return None if p == rec else (path, rec, p)

    def _emit(self, e: LaneEmit, path: str) -> Found | None:
        """The tokens an emit names, and its logits row (as a digest)."""
        if e.n_tokens:
            ref = tuple(e.token_ref)
            a, b = self.rec.tokens_at(ref), self.rep.tokens_at(ref)
            if a != b:
                if a is None or b is None:
                    return (f"{path}.tokens", a, b)
                ta, tb = _u32(a), _u32(b)
                j = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
                return (f"{path}.tokens[{j}]", ta[j] if j < len(ta) else None, tb[j] if j < len(tb) else None)
        if e.logits_row.len:
            ref = tuple(e.logits_row)
            a, b = self.rec.logits.get(ref), self.rep.logits.get(ref)
            if a != b:
                return (f"{path}.logits_row (blake2b of the row's bytes)", a, b)
        return None


def _u32(b: bytes) -> list[int]:
    return [int.from_bytes(b[i:i + 4], "little") for i in range(0, len(b), 4)]


def first_difference(recorded: Any, replayed: Any, rec_writes: Writes, rep_writes: Writes) -> Found | None:
    """The first field of the replayed outcome (a record) that differs from
    the recorded one (each emit with the tokens it names), then how much
    was written to the rings."""
    w = Walk(rec_writes, rep_writes)
    found = w.walk(recorded, replayed, "")
    if found:
        return found
    a, b = rec_writes.tokens, rep_writes.tokens
    if (a is None) != (b is None) or (a is not None and b is not None and len(a) != len(b)):
        return ("elements written to the token ring", None if a is None else len(a) // 4,
                None if b is None else len(b) // 4)
    if rec_writes.logits != rep_writes.logits:
        return ("rows written to the logits ring", sorted(rec_writes.logits), sorted(rep_writes.logits))
    return None
