"""The C ABI: records, constants and shared-memory primitives of superfluid.h.

`ffi` and `lib` come from the cffi module compiled from the header; the
enums and numpy record dtypes below are derived from it, never restated by
hand (header_types.pyi, generated from them, states the enums for a type checker).
"""

from __future__ import annotations

if __name__ != "superfluid.abi":  # imported by its bare name from a checkout's root: not ours
    from superfluid.checkout import not_ours

    not_ours(__name__, __file__)

import enum
import os
from typing import TYPE_CHECKING, Any

import numpy as np

try:
    from superfluid.abi._native import ffi as ffi, lib as lib
except ImportError as e:  # pragma: no cover - only on a broken install
    raise ImportError(
        "superfluid.abi._native is not built; install the package (pip install -e .) "
        "so that the cffi extension is compiled"
    ) from e

HEADER_PATH = os.path.join(os.path.dirname(__file__), "superfluid.h")

ABI_VERSION: int = lib.SF_ABI_VERSION
MAGIC: int = lib.SF_MAGIC
MAX_TOP_LOGPROBS: int = lib.SF_MAX_TOP_LOGPROBS
ARENA_ALIGN: int = lib.SF_ARENA_ALIGN
CACHE_LINE: int = lib.SF_CACHE_LINE


def _constants(prefix: str) -> dict[str, int]:
    return {
        name[len(prefix):]: getattr(lib, name)
        for name in dir(lib)
        if name.startswith(prefix) and isinstance(getattr(lib, name), int)
    }


def _enum(cls_name: str, prefix: str, exclude: tuple[str, ...] = (), flag: bool = False) -> type[enum.Enum]:
    members = {k: v for k, v in _constants(prefix).items() if not k.startswith(exclude or ("\0",))}
    base: enum.EnumMeta = enum.IntFlag if flag else enum.IntEnum
    names: list[tuple[str, int]] = sorted(members.items(), key=lambda kv: kv[1])
    return base(cls_name, names, module=__name__)


if TYPE_CHECKING:  # the same enums, stated for a type checker (abi/gen_types.py)
    from superfluid.abi.header_types import (
        AdmitStatus as AdmitStatus,
        CacheClass as CacheClass,
        Connect as Connect,
        Determinism as Determinism,
        Fault as Fault,
        Finish as Finish,
        MsgKind as MsgKind,
        OpKind as OpKind,
        OpStatus as OpStatus,
        ParamFlag as ParamFlag,
        PlanFlag as PlanFlag,
        QueueKind as QueueKind,
        RingId as RingId,
        RuntimeFlag as RuntimeFlag,
        Sampling as Sampling,
        ShedKind as ShedKind,
        ShedReason as ShedReason,
        Status as Status,
        TickStatus as TickStatus,
        WaitResult as WaitResult,
        WorkerState as WorkerState,
    )
else:
    Status = _enum("Status", "SF_STATUS_")
    TickStatus = _enum("TickStatus", "SF_TICK_")
    PlanFlag = _enum("PlanFlag", "SF_PLAN_", exclude=("FLAGS_ALL",), flag=True)
    CacheClass = _enum("CacheClass", "SF_CACHE_", exclude=("CLASSES_ALL", "LINE"), flag=True)
    Sampling = _enum("Sampling", "SF_SAMPLING_")
    ParamFlag = _enum("ParamFlag", "SF_PARAM_", exclude=("FLAGS_ALL",), flag=True)
    Determinism = _enum("Determinism", "SF_CLASS_")
    AdmitStatus = _enum("AdmitStatus", "SF_ADMIT_")
    Finish = _enum("Finish", "SF_FINISH_")
    Fault = _enum("Fault", "SF_FAULT_", exclude=("DETAIL_",))  # SF_FAULT_DETAIL_INJECTED is a bit of detail
    ShedKind = _enum("ShedKind", "SF_SHED_", exclude=("REASON_",))
    ShedReason = _enum("ShedReason", "SF_SHED_REASON_")
    RingId = _enum("RingId", "SF_RING_")
    MsgKind = _enum("MsgKind", "SF_MSG_")
    OpKind = _enum("OpKind", "SF_OP_")
    OpStatus = _enum("OpStatus", "SF_OPST_")
    WorkerState = _enum("WorkerState", "SF_WORKER_")
    RuntimeFlag = _enum("RuntimeFlag", "SF_RT_", flag=True)
    WaitResult = _enum("WaitResult", "SF_WAIT_", exclude=("SLICE_NS",))
    QueueKind = _enum("QueueKind", "SF_QUEUE_")
    Connect = _enum("Connect", "SF_CONNECT_")
PLAN_SEQ_MAX: int = lib.SF_PLAN_SEQ_MAX
ECHO_BYTES: int = lib.SF_ECHO_BYTES

PLAN_FLAGS_ALL: int = lib.SF_PLAN_FLAGS_ALL
PARAM_FLAGS_ALL: int = lib.SF_PARAM_FLAGS_ALL
CACHE_CLASSES_ALL: int = lib.SF_CACHE_CLASSES_ALL


# ------------------------------------------------------------ numpy dtypes

_PRIMITIVES = {
    "uint8_t": "u1", "uint16_t": "<u2", "uint32_t": "<u4", "uint64_t": "<u8",
    "int8_t": "i1", "int16_t": "<i2", "int32_t": "<i4", "int64_t": "<i8",
    "float": "<f4", "double": "<f8", "char": "S1",
}


def _np_type(ctype: Any) -> np.dtype[Any]:
    if ctype.kind == "primitive":
        return np.dtype(_PRIMITIVES[ctype.cname])
    if ctype.kind == "array":
        item = _np_type(ctype.item)
        if ctype.item.cname == "char":
            return np.dtype(f"S{ctype.length}")
        return np.dtype((item, (ctype.length,)))
    if ctype.kind == "struct":
        return record_dtype(ctype.cname.removeprefix("struct "))
    raise TypeError(f"no numpy type for {ctype.cname}")


_DTYPES: dict[str, np.dtype[Any]] = {}


def record_dtype(name: str) -> np.dtype[Any]:
    """A numpy structured dtype with the C layout of struct `name` (offsets
    and size from the compiler, through cffi); padding fields are kept out."""
    dt = _DTYPES.get(name)
    if dt is None:
        ct = ffi.typeof(name)
        names, formats, offsets = [], [], []
        for fname, field in ct.fields:
            if fname.startswith("_pad") or fname.startswith("_reserved"):
                continue
            names.append(fname)
            formats.append(_np_type(field.type))
            offsets.append(field.offset)
        dt = np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": ffi.sizeof(ct)})
        _DTYPES[name] = dt
    return dt


def sizeof(name: str) -> int:
    return int(ffi.sizeof(name))
