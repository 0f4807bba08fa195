"""What op DESCRIBE says that a client reads as a type: the worker's parallel
layout (contract §7.3). The rest of the payload stays the msgpack map."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from superfluid.client.session import ClientError


class Parallel(NamedTuple):
    """DESCRIBE's `parallel`: `tp` rank processes run the worker's model, on
    `nnodes` machines. The planner sees one worker at every degree."""

    tp: int = 1
    nnodes: int = 1


def parallel_of(body: Mapping[str, Any]) -> Parallel:
    """The layout a DESCRIBE payload states; an older worker's, without the
    key, is one rank on one machine. ClientError names a bad value."""
    raw = body.get("parallel")
    if raw is None:
        return Parallel()
    if not isinstance(raw, Mapping):
        raise ClientError(f"DESCRIBE payload: 'parallel' is not a map: {raw!r}")
    vals: dict[str, int] = {}
    for name in Parallel._fields:
        v = raw.get(name, 1)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ClientError(f"DESCRIBE payload: parallel.{name} must be an int >= 1, got {v!r}")
        vals[name] = v
    out = Parallel(**vals)
    if out.nnodes > out.tp:
        raise ClientError(f"DESCRIBE payload: parallel.nnodes {out.nnodes} exceeds tp {out.tp}")
    return out
