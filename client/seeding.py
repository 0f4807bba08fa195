"""The reference planner's use of seed leases (contract §6, §7).

The planner remembers which whole pages it has had the worker publish (a
lane retired with `publish_to_cache`, and on an exact_only runtime every
long prompt, which the worker checkpoints on its own). A new admission whose
first page is among them asks LEASE_SEED for its tokens first; the lease's
`value` tokens are then skipped by prefill (and, on a paged runtime, by
decode_replay for a re-admitted request). A lease dies with its worker: after a restart the
planner forgets them all and starts from scratch, as the new worker does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from superfluid.abi import Determinism, OpStatus

SPI = int(Determinism.SEED_PATH_INVARIANT)
LEASE_TTL_TICKS = 16  # long enough to survive a few NeedsReplan rounds before its admit
_MAX_REMEMBERED = 1 << 18  # page chains remembered before the book starts over
CHECKPOINT_MIN_TOKENS = 128  # the worker checkpoints prompts this long on an exact_only runtime


@dataclasses.dataclass
class Seed:
    handle: int
    value: int  # tokens the lease covers


class SeedBook:
    def __init__(self, client: Any, page: int, exact_only: bool):
        self.client = client
        self.page = max(1, page)
        self.exact_only = exact_only
        self._chains: set[int] = set()  # hash chain of every whole-page prefix published
        self.leases = 0  # LEASE_SEED answered OK
        self.misses = 0  # LEASE_SEED answered NoMatch (or no room)

    def _walk(self, tokens):
        h = 0
        p = self.page
        for k in range(len(tokens) // p):
            h = hash((h, tuple(tokens[k * p:(k + 1) * p])))
            yield h

    def published(self, tokens) -> None:
        """The worker keeps these tokens (whole pages of them) in its cache."""
        if len(self._chains) > _MAX_REMEMBERED:
            self._chains.clear()
        self._chains.update(self._walk(tokens))

    def admitted(self, prompt) -> None:
        """An exact_only worker checkpoints a long prompt one token short."""
        if self.exact_only and len(prompt) >= CHECKPOINT_MIN_TOKENS:
            self.published(prompt)

    def may_share(self, tokens) -> bool:
        first = next(iter(self._walk(tokens)), None)
        return first is not None and first in self._chains

    def lease(self, tokens, timeout: float | None, replay: int = 0) -> Seed | None:
        """A lease on the longest cached prefix of `tokens` (an admission's
        prompt, whose last `replay` tokens decode_replay feeds), or None."""
        # exact_only: decode feeds the last token prefill reaches and the replayed
        # ones, which a seed's state holds as prefill fed them: lease short of them.
        asked = list(tokens[:max(0, len(tokens) - replay - 1)]) if self.exact_only else list(tokens)
        if not asked or not self.may_share(asked):
            return None
        done = self.client.op("LEASE_SEED", timeout, tokens=asked, ttl_ticks=LEASE_TTL_TICKS, determinism_class=SPI)
        if done.status != OpStatus.OK:
            self.misses += 1
            return None
        self.leases += 1
        return Seed(done.handle, done.value)

    def forget(self) -> None:
        """The worker restarted: its cache and leases are gone."""
        self._chains.clear()
