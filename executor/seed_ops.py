"""The seed ops (contract §7): LEASE_SEED, RELEASE_SEED, EXPORT_ENTRY, IMPORT_STATE.

Each returns (handle, value, payload) or raises OpError; none changes a
lane, and a failure leaves the cache and the lease table as they were.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgpack

from superfluid.abi import Determinism, OpStatus
from superfluid.engine.runtime import CapacityError, FatalError, RuntimeFailure, Unsupported
from superfluid.executor.op_fields import OpError, OpMessage, echo, handle, tokens, u32
from superfluid.executor.seeds import EnvelopeError, SeedLease, find_prefix, unwrap, wrap
from superfluid.executor.state_dir import StateDir

if TYPE_CHECKING:
    from superfluid.executor.executor import Executor

# What an op completion may carry inline when the event slot's size is not
# known (in-process there is no slot: no limit).
_MSGPACK_SLACK = 64
MAX_BLOB_FILE = 1 << 36


def _ttl(msg: OpMessage) -> int:
    return u32(msg, "ttl_ticks", lo=1)


def _room(ex: Executor) -> None:
    ex.sweep_leases()
    if ex.leases.full:
        raise OpError(OpStatus.Capacity, f"the lease table holds {ex.leases.capacity} leases; release some "
                                         f"or let them expire")


def _class(msg: OpMessage) -> int:
    det = u32(msg, "determinism_class", int(Determinism.SEED_PATH_INVARIANT))
    if det not in {int(d) for d in Determinism}:
        raise OpError(OpStatus.BadRequest, f"field 'determinism_class': {det} is not a determinism class")
    return det


def lease_seed(ex: Executor, msg: OpMessage) -> tuple[int, int, bytes]:
    toks = tokens(msg, "tokens", ex.desc.vocab_size)
    ttl = _ttl(msg)
    det = _class(msg)
    _room(ex)
    hit = find_prefix(ex.cache, toks, ex.exact_only)
    if hit is None:
        what = "a checkpoint's whole key" if ex.exact_only else f"a whole page ({ex.page} tokens)"
        raise OpError(OpStatus.NoMatch, f"no cache entry shares {what} with the {len(toks)} tokens")
    entry, n = hit
    lease = SeedLease(ex.registry.new_handle(), entry, tuple(toks[:n]), det, ex.counters.tick_count + ttl)
    ex.leases.add(lease)
    return lease.handle, n, b""


def release_seed(ex: Executor, msg: OpMessage) -> tuple[int, int, bytes]:
    h = handle(msg)
    lease = ex.leases.get(h)
    if lease is None:
        raise OpError(OpStatus.UnknownHandle, f"no seed lease {h}")
    ex.leases.drop(lease)
    return h, 0, b""


def export_entry(ex: Executor, msg: OpMessage) -> tuple[int, int, bytes]:
    h = handle(msg)
    path = msg.get("path")
    overwrite = msg.get("overwrite", False)
    if not isinstance(overwrite, bool):
        raise OpError(OpStatus.BadRequest, f"field 'overwrite': expected a bool, got {echo(overwrite)}")
    if path is not None:
        _state_dir(ex).check(path)  # a bad path is refused before the export's work
    ex.sweep_leases()
    lease = ex.leases.get(h)
    if lease is None:
        raise OpError(OpStatus.UnknownHandle, f"no seed lease {h}")
    # The whole entry goes (no copy to cut it: that could need cells the pool has
    # not got); the importer names the tokens it wants, a prefix of these.
    e = lease.entry
    try:
        inner = e.exported_blob() if not e.resident else ex.runtime.seq_export(e.resident_seq())
    except FatalError as err:
        raise OpError(OpStatus.Refused, str(ex.fatal("EXPORT_ENTRY", err))) from err
    except Unsupported as err:
        raise OpError(OpStatus.Unsupported, f"the {ex.desc.runtime_id} runtime cannot export: {err}") from None
    except RuntimeFailure as err:
        raise OpError(OpStatus.Unsupported, f"export failed: {err}") from None
    held = e.tokens
    blob = wrap(ex.desc.runtime_id, held, inner)
    if path is not None:
        _state_dir(ex).write(path, blob, overwrite=overwrite)
        return h, len(blob), b""
    if ex.event_capacity is not None and len(blob) + _MSGPACK_SLACK > ex.event_capacity // 2:
        raise OpError(OpStatus.BadRequest, f"the blob is {len(blob)} bytes, more than an op completion carries "
                                           f"(about {ex.event_capacity // 2}); give a 'path' to write it to")
    return h, len(blob), msgpack.packb({"blob": blob})


def _state_dir(ex: Executor) -> StateDir:
    if ex.state_dir is None:
        raise OpError(OpStatus.BadRequest, "field 'path': this executor has no state directory to hold files "
                                           "(serve --state-dir; in process, Executor(state_dir=...))")
    return ex.state_dir


def _import_cap(ex: Executor) -> int:
    """The most bytes an import from a file may read: the runtime's largest
    export in its envelope (with the longest sequence's tokens)."""
    envelope = len(wrap(ex.desc.runtime_id, (), b"")) + 4 * ex.desc.max_seq_len
    return min(MAX_BLOB_FILE, envelope + ex.runtime.export_bytes_max())


def _read_blob(ex: Executor, msg: OpMessage) -> bytes:
    if "blob" in msg:
        b = msg["blob"]
        if not isinstance(b, (bytes, bytearray)):
            raise OpError(OpStatus.BadRequest, f"field 'blob': expected bytes, got {type(b).__name__}")
        return bytes(b)
    if "path" not in msg:
        raise OpError(OpStatus.BadRequest, "field 'blob' or 'path' is missing")
    return _state_dir(ex).read(msg["path"], _import_cap(ex))


def import_state(ex: Executor, msg: OpMessage) -> tuple[int, int, bytes]:
    toks = tokens(msg, "tokens", ex.desc.vocab_size)
    ttl = _ttl(msg)
    det = _class(msg)
    blob = _read_blob(ex, msg)
    try:
        rid, held, inner = unwrap(blob)
    except EnvelopeError as err:
        raise OpError(OpStatus.BadRequest, f"field 'blob': {err}") from None
    if rid != ex.desc.runtime_id:
        raise OpError(OpStatus.BadRequest, f"field 'blob': exported by runtime {echo(rid)}, this worker runs "
                                           f"{ex.desc.runtime_id!r}")
    if not ex.exact_only:  # the cache keeps whole pages on a paged runtime
        if len(toks) < ex.page:
            raise OpError(OpStatus.BadRequest, f"field 'tokens': {len(toks)} tokens, less than a page ({ex.page})")
        toks = toks[:len(toks) // ex.page * ex.page]
    n = len(toks)
    if n > len(held) or tuple(toks) != held[:n]:
        raise OpError(OpStatus.BadRequest, f"field 'tokens': not a prefix of the {len(held)} tokens the blob holds")
    if ex.exact_only and n != len(held):
        raise OpError(OpStatus.BadRequest, f"field 'tokens': an exact_only state holds exactly {len(held)} tokens")
    if n > ex.desc.max_seq_len:
        raise OpError(OpStatus.BadRequest, f"field 'tokens': {n} tokens > max_seq_len {ex.desc.max_seq_len}")
    _room(ex)
    rt = ex.runtime
    seq = None
    try:
        seq = rt.seq_create()
        got = rt.seq_import(seq, inner)
        if got != len(held):
            raise OpError(OpStatus.BadRequest, f"field 'blob': it holds {got} cells, its header says {len(held)}")
        if n < got:
            rt.seq_truncate(seq, n)
    except FatalError as err:
        raise OpError(OpStatus.Refused, str(ex.fatal("IMPORT_STATE", err))) from err
    except (OpError, RuntimeFailure) as err:
        if seq is not None:
            try:
                rt.seq_free(seq)
            except FatalError as err2:
                raise OpError(OpStatus.Refused, str(ex.fatal("IMPORT_STATE", err2))) from err2
            except RuntimeFailure:
                pass
        if isinstance(err, OpError):
            raise
        if isinstance(err, CapacityError):
            raise OpError(OpStatus.Capacity, f"no room for the import: {err}") from None
        raise OpError(OpStatus.BadRequest, f"field 'blob': {err}") from None
    entry = ex.cache.insert(seq, tuple(toks), n, ex.entry_bytes(n), ex.counters.tick_count, bare=True)
    lease = SeedLease(ex.registry.new_handle(), entry, tuple(toks), det, ex.counters.tick_count + ttl, adopt=True)
    ex.leases.add(lease)
    return lease.handle, n, b""
