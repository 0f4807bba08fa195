"""The reference planner's grammars (contract §3 step 4, §7).

A grammar handle is borrowed by one lane at a time, so the planner
registers each constrained request's grammar for that request alone, when
it is submitted (a bad grammar fails the submit with the worker's message),
and releases it once the request is done. A handle dies with its worker:
after a restart the book forgets them and the next admission registers
again. A re-admitted request replays its generated tokens into the fresh
matcher (`grammar_replay = generated`), so it goes on exactly where it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from superfluid.abi import OpStatus
from superfluid.client.session import WorkerRestarted

# (kind, text) with kind json_schema, regex, lark or gbnf; ("choice", [str, ...]).
GrammarSpec = tuple[str, str | Sequence[str]]


class GrammarRefused(ValueError):
    """The worker cannot use the grammar: its message says why."""


def fields(spec: GrammarSpec) -> dict[str, Any]:
    kind, text = spec
    if kind == "choice":
        if isinstance(text, str) or not all(isinstance(c, str) for c in text):
            raise ValueError("a choice grammar is a list of strings")
        return {"kind": kind, "choices": list(text)}
    if not isinstance(text, str):
        raise ValueError(f"a {kind} grammar is a string")
    return {"kind": kind, "text": text}


class GrammarBook:
    def __init__(self, client: Any):
        self.client = client
        self._handles: dict[int, int] = {}  # request id -> handle on the current worker
        self.registered = 0

    def handle(self, req_id: int, spec: GrammarSpec, timeout: float | None) -> int:
        """The request's handle, registering the grammar if this worker has none for it."""
        h = self._handles.get(req_id)
        if h is None:
            done = self.client.op("REGISTER_GRAMMAR", timeout, **fields(spec))
            if done.status != OpStatus.OK:
                raise GrammarRefused(f"{spec[0]} grammar refused: {OpStatus(done.status).name}: {_error(done)}")
            h = self._handles[req_id] = done.handle
            self.registered += 1
        return h

    def release(self, req_id: int, timeout: float | None) -> None:
        """The request is done: its grammar can go."""
        h = self._handles.pop(req_id, None)
        if h is None:
            return
        try:
            self.client.op("RELEASE_GRAMMAR", timeout, handle=h)  # UnknownHandle: gone anyway
        except WorkerRestarted:
            pass  # gone with its worker (the planner's next tick sees the restart)

    def forget(self) -> None:
        """The worker restarted: its grammars are gone."""
        self._handles.clear()


def _error(done) -> str:
    try:
        return str(msgpack.unpackb(done.payload, raw=False).get("error", ""))
    except (ValueError, AttributeError, msgpack.ExtraData):  # not a map: nothing more to say
        return ""
