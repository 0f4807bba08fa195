"""The reference planner's speculation strategy (contract §7 INSTALL_STRATEGY, §4 overshoot).

A strategy lives in a slot of the worker; admits that name the slot may
draft (the worker decides which lanes do: not HOST, grammar, logit-bias or
logprob lanes) and its cert_id comes back in their AdmitResult. Drafting
never changes a lane's tokens, so the planner treats a drafting lane as any
other, but grants it `overshoot`: verified tokens past the tick's grant, up
to what the request has left. The slot dies with its worker: after a
restart the book forgets it and installs it again at the next admission.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from superfluid.abi import OpStatus


class StrategyRefused(ValueError):
    """The worker cannot install the strategy: its message says why."""


@dataclasses.dataclass(frozen=True)
class Strategy:
    """Prompt lookup: draft up to max_draft tokens that followed the latest
    earlier occurrence of the lane's last n tokens (ngram_max down to ngram_min)."""

    max_draft: int = 8
    ngram_min: int = 1
    ngram_max: int = 4
    kind: str = "prompt_lookup"
    slot: int = 1

    def fields(self) -> dict[str, Any]:
        return {"slot": self.slot, "kind": self.kind, "max_draft": self.max_draft,
                "ngram_min": self.ngram_min, "ngram_max": self.ngram_max}


class StrategyBook:
    def __init__(self, client: Any, strategy: Strategy | None):
        self.client = client
        self.strategy = strategy
        self.cert_id: int | None = None  # on the current worker; None: not installed there
        self.installs = 0

    def slot(self, timeout: float | None) -> int:
        """The slot an admission names (0: none), installing the strategy on this worker first."""
        if self.strategy is None:
            return 0
        if self.cert_id is None:
            done = self.client.op("INSTALL_STRATEGY", timeout, **self.strategy.fields())
            if done.status != OpStatus.OK:
                raise StrategyRefused(f"{self.strategy.kind} strategy refused: {OpStatus(done.status).name}: "
                                      f"{_error(done)}")
            self.cert_id = int(done.value)
            self.installs += 1
        return self.strategy.slot

    def forget(self) -> None:
        """The worker restarted: its strategy slots are gone."""
        self.cert_id = None


def _error(done) -> str:
    try:
        return str(msgpack.unpackb(done.payload, raw=False).get("error", ""))
    except (ValueError, AttributeError, msgpack.ExtraData):
        return ""
