"""Ops (contract §7): msgpack maps {op, op_id, ...} that change executor state
between ticks. An op's failure is its completion's status; it never affects
a tick. INSTALL_STRATEGY fills a slot of speculation.py's table (Unsupported
where the runtime cannot verify drafts). Grammars compile in grammar.py; a
runtime without a tokenizer answers Unsupported. The seed ops are in
seed_ops.py, the lane ops in lane_ops.py. An error message quotes at most
ECHO_BYTES of any input value and is clipped whole here, so no input makes a
completion big."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import msgpack
import numpy as np

from superfluid.abi import ABI_VERSION, Fault, OpKind, OpStatus, ShedKind, ShedReason
from superfluid.abi.records import OpCompletion, ShedEntry
from superfluid.engine.runtime import FatalError, RuntimeFailure
from superfluid.executor import faults, grammar as gr, host_sampling as hs, speculation as spec
from superfluid.executor.op_fields import (
    MAX_ERROR_BYTES,
    OpError,
    OpMessage,
    clip,
    echo,
    field as _field,
    handle as _handle,
    u32 as _u32,
)

if TYPE_CHECKING:
    from superfluid.executor.executor import Executor

_F32_MAX = float(np.finfo(np.float32).max)


def _op_kind(v: object) -> OpKind:
    if isinstance(v, str):
        try:
            return OpKind[v.upper()]
        except KeyError:
            raise OpError(OpStatus.UnknownOp, f"op {echo(v)} is not one of {', '.join(k.name for k in OpKind)}"
                          ) from None
    if isinstance(v, int) and not isinstance(v, bool):
        try:
            return OpKind(v)
        except ValueError:
            raise OpError(OpStatus.UnknownOp, f"op {echo(v)} is not an op code") from None
    raise OpError(OpStatus.BadRequest, f"field 'op': expected a name or a code, got {type(v).__name__}")


def decode_op(payload: bytes) -> OpMessage:
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several types on garbage
        raise OpError(OpStatus.BadRequest, f"not msgpack: {e}") from None
    if not isinstance(msg, dict):
        raise OpError(OpStatus.BadRequest, f"an op is a msgpack map, got {type(msg).__name__}")
    return msg


def run_op(ex: Executor, msg: OpMessage | bytes) -> OpCompletion:
    """Apply one op to the executor; its completion (never raises for bad input)."""
    op_id, kind = 0, 0
    try:
        if not isinstance(msg, dict):
            msg = decode_op(msg)
        got = msg.get("op_id", 0)
        if not isinstance(got, int) or isinstance(got, bool) or not 0 <= got < 1 << 64:
            raise OpError(OpStatus.BadRequest, "field 'op_id': expected an unsigned 64-bit integer")
        op_id = got
        kind = _op_kind(msg.get("op"))
        if ex.faults is not None and ex.faults.ops and ex.fault_rt is not None:
            try:
                ex.faults.on_op(int(kind), ex, ex.fault_rt)
            except FatalError as err:
                raise OpError(OpStatus.Refused, str(ex.fatal(kind.name, err))) from err
        handle, value, payload = _OPS[kind](ex, msg)
        return OpCompletion(op_id=op_id, status=int(OpStatus.OK), op=int(kind), handle=handle, value=value,
                            payload=payload)
    except OpError as e:
        return OpCompletion(op_id=op_id, status=int(e.status), op=int(kind),
                            payload=msgpack.packb({"error": clip(str(e), MAX_ERROR_BYTES)}))


def _describe(ex: Executor, msg: OpMessage) -> tuple[int, int, bytes]:
    d = ex.desc
    voc = ex.runtime.vocabulary()
    body = {
        "abi_version": ABI_VERSION, "worker_epoch": ex.epoch,
        "runtime": {
            "runtime_id": d.runtime_id, "vocab_size": d.vocab_size, "max_seq_len": d.max_seq_len,
            "max_batch": d.max_batch, "max_seqs": d.max_seqs, "page": d.page,
            "truncate_partial": d.truncate_partial, "copy_shares_cells": d.copy_shares_cells,
            "takeover_preferred": d.takeover_preferred, "prefill_step_tokens": d.prefill_step_tokens,
            "engine_sampling": d.engine_sampling, "engine_draws": d.engine_draws,
            "verify_batches": d.verify_batches, "exact_only": d.exact_only,
        },
        "parallel": {"tp": d.tp, "nnodes": d.nnodes},
        "numeric": {"class": d.numeric_class, "isa": d.isa},
        "eos": sorted(voc.eos), "specials": dict(voc.specials),
        "fault_injection": ex.fault_injection,
    }
    return 0, d.vocab_size, msgpack.packb(body)


def _register_bias(ex: Executor, msg: OpMessage) -> tuple[int, int, bytes]:
    raw = _field(msg, "bias", (dict, list))
    items = raw.items() if isinstance(raw, dict) else cast("list[object]", raw)  # field checked: dict or list
    ids: list[int] = []
    vals: list[float] = []
    for item in items:
        try:
            tid, val = cast("Iterable[object]", item)  # whatever it is: this line raises on a non-pair
        except (TypeError, ValueError):
            raise OpError(OpStatus.BadRequest, "field 'bias': entries are [token, value] pairs") from None
        if not isinstance(tid, int) or isinstance(tid, bool) or not 0 <= tid < ex.desc.vocab_size:
            raise OpError(OpStatus.BadRequest, f"field 'bias': token {echo(tid)} is outside the vocabulary")
        # Stored as float32: a value beyond its range would turn into +inf,
        # which greedy reads as "force" but the sampler as "never".
        if (not isinstance(val, (int, float)) or isinstance(val, bool) or math.isnan(val)
                or (val != -math.inf and abs(val) > _F32_MAX)):
            raise OpError(OpStatus.BadRequest, f"field 'bias': value {echo(val)} of token {tid} "
                                               f"(|v| <= {_F32_MAX:.4g}, or -inf to ban)")
        ids.append(tid)
        vals.append(float(val))
    if len(set(ids)) != len(ids):
        raise OpError(OpStatus.BadRequest, "field 'bias': a token appears twice")
    h = ex.registry.next_handle
    ex.registry.next_handle += 1
    ex.registry.biases[h] = hs.as_bias_arrays(dict(zip(ids, vals)))  # arrays once, not per sampled token
    return h, len(ids), b""


def _release_bias(ex: Executor, msg: OpMessage) -> tuple[int, int, bytes]:
    h = _handle(msg)
    if ex.registry.biases.pop(h, None) is None:
        raise OpError(OpStatus.UnknownHandle, f"no logit bias {h}")
    return h, 0, b""


def _register_grammar(ex: Executor, msg: OpMessage) -> tuple[int, int, bytes]:
    reg = ex.registry.grammars
    if not reg.supported:  # before the fields: no grammar of any kind can work here
        raise OpError(OpStatus.Unsupported, "grammars need a tokenizer: this runtime has none "
                                            "(no tokenizer.json in its checkpoint)")
    kind = _field(msg, "kind", str)
    if kind not in gr.KINDS:
        raise OpError(OpStatus.BadRequest, f"field 'kind': {echo(kind)} is not one of {', '.join(gr.KINDS)}")
    text = _field(msg, "choices", list) if kind == "choice" else _field(msg, "text", str)
    if reg.full:
        raise OpError(OpStatus.Capacity, f"{len(reg)} grammars are registered, the most there may be")
    try:
        g = reg.compile(kind, text)
    except gr.GrammarsUnsupported as e:
        raise OpError(OpStatus.Unsupported, str(e)) from None
    except gr.GrammarError as e:
        raise OpError(OpStatus.BadRequest, f"{kind}: {e}") from None
    h = ex.registry.new_handle()
    reg.add(h, g)
    return h, g.compile_us, b""


def _release_grammar(ex: Executor, msg: OpMessage) -> tuple[int, int, bytes]:
    h = _handle(msg)
    if not ex.registry.grammars.release(h):
        raise OpError(OpStatus.UnknownHandle, f"no grammar {h}")
    return h, 0, b""


def _install_strategy(ex: Executor, msg: OpMessage) -> tuple[int, int, bytes]:
    """Fill (or replace) a strategy slot; value = its new cert_id. Lanes admitted
    earlier keep the strategy they got."""
    why = spec.unsupported_because(ex.runtime)
    if why is not None:  # before the fields: no strategy of any kind can work here
        raise OpError(OpStatus.Unsupported, why)
    slot = _u32(msg, "slot", lo=1, hi=spec.MAX_SLOTS)
    kind = _field(msg, "kind", str)
    if kind not in spec.KINDS:
        raise OpError(OpStatus.BadRequest, f"field 'kind': {echo(kind)} is not one of {', '.join(spec.KINDS)}")
    max_draft = _u32(msg, "max_draft", lo=1, hi=spec.MAX_DRAFT)
    ngram_min = _u32(msg, "ngram_min", lo=1, hi=spec.MAX_NGRAM)
    ngram_max = _u32(msg, "ngram_max", lo=ngram_min, hi=spec.MAX_NGRAM)
    st = ex.registry.strategies.install(slot, kind, max_draft, ngram_min, ngram_max)
    return 0, st.cert_id, b""


def _inject_fault(ex: Executor, msg: OpMessage) -> tuple[int, int, bytes]:
    if not ex.fault_injection:
        raise OpError(OpStatus.Refused, "fault injection is off (start the worker with --fault-injection)")
    tag = _field(msg, "lane_tag", int)
    code = msg.get("code", int(Fault.INJECTED))
    if not isinstance(code, int) or code not in {int(f) for f in Fault}:
        raise OpError(OpStatus.BadRequest, f"field 'code': {echo(code)} is not a fault code")
    if tag not in ex.lanes:
        raise OpError(OpStatus.NoMatch, f"no live lane {echo(tag)}")
    ex.lanes.injected[tag] = code
    return 0, tag, b""


def _fault_ops(ex: Executor) -> None:
    if not ex.fault_injection:
        raise OpError(OpStatus.Refused, "fault injection is off (start the worker with --fault-injection)")


def _install_faults(ex: Executor, msg: OpMessage) -> tuple[int, int, bytes]:
    _fault_ops(ex)
    schedule = faults.parse_schedule(_field(msg, "rules", list), msg.get("seed", 0))
    ex.install_faults(schedule)  # what the old rules armed goes with them
    return 0, len(schedule), b""


def _list_faults(ex: Executor, msg: OpMessage) -> tuple[int, int, bytes]:
    _fault_ops(ex)
    listing = ex.faults.listing() if ex.faults is not None else {"seed": 0, "rules": []}
    body = msgpack.packb(listing)
    if ex.event_capacity is not None and len(body) > ex.event_capacity // 2:
        raise OpError(OpStatus.Capacity, f"the listing takes {len(body)} bytes, more than half an event slot")
    return 0, len(ex.faults or ()), body


def _clear_faults(ex: Executor, msg: OpMessage) -> tuple[int, int, bytes]:
    _fault_ops(ex)
    return 0, ex.install_faults(None), b""


def _cache_clear(ex: Executor, msg: OpMessage) -> tuple[int, int, bytes]:
    freed = 0
    for e in ex.cache.lru(resident=False):  # the host tier: nothing of the pool
        ex.cache.remove(e)
    for e in ex.cache.lru():
        ex.cache.remove(e)
        try:
            ex.runtime.seq_free(e.resident_seq())
        except FatalError as err:
            # The worker's fatal path; in-process the executor refuses ticks from now on.
            raise OpError(OpStatus.Refused, str(ex.fatal("CACHE_CLEAR", err))) from err
        except RuntimeFailure:
            pass  # the runtime holds nothing more of it that we could free
        # Reported in the next tick's shed report, so the counters reconcile.
        ex.pending.shed.append(ShedEntry(lane_tag=0, kind=int(ShedKind.CACHE_EVICTION),
                                         reason=int(ShedReason.CLEARED), bytes=e.bytes, tokens=len(e.tokens)))
        freed += e.bytes
    return 0, freed, b""


from superfluid.executor import lane_ops, seed_ops  # noqa: E402 (they use the field readers above)

_OPS = {
    OpKind.DESCRIBE: _describe,
    OpKind.REGISTER_LOGIT_BIAS: _register_bias,
    OpKind.RELEASE_LOGIT_BIAS: _release_bias,
    OpKind.INJECT_FAULT: _inject_fault,
    OpKind.CACHE_CLEAR: _cache_clear,
    OpKind.LEASE_SEED: seed_ops.lease_seed,
    OpKind.RELEASE_SEED: seed_ops.release_seed,
    OpKind.REGISTER_GRAMMAR: _register_grammar,
    OpKind.RELEASE_GRAMMAR: _release_grammar,
    OpKind.INSTALL_STRATEGY: _install_strategy,
    OpKind.EXPORT_ENTRY: seed_ops.export_entry,
    OpKind.IMPORT_STATE: seed_ops.import_state,
    OpKind.LIST_LANES: lane_ops.list_lanes,
    OpKind.RETIRE_LANES: lane_ops.retire_lanes,
    OpKind.INSTALL_FAULTS: _install_faults,
    OpKind.LIST_FAULTS: _list_faults,
    OpKind.CLEAR_FAULTS: _clear_faults,
}
