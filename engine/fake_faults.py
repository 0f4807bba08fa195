"""Fault injection for the fake runtime: failures a test asks for, at a call site.

An injection fires after a call's own checks pass and before it changes
anything. A FatalError poisons the runtime: every later call raises
FatalError, as a lost device would, until clear_faults().
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from superfluid.abi import Fault
from superfluid.engine.fake_stats import FakeStats
from superfluid.engine.runtime import CapacityError, FatalError, LaneFault

FaultSite = Literal["step", "copy", "truncate", "import", "export", "create", "free", "any"]
_SITES = frozenset(("step", "copy", "truncate", "import", "export", "create", "free", "any"))


class FaultInjection:
    """Mixed into FakeRuntime: the injections pending and the poison. Counts
    what it raises in self.stats.faults; _alive also refuses a closed runtime."""

    _closed: bool
    stats: FakeStats

    def _init_faults(self) -> None:
        self._lane_faults: dict[int, list[int]] = {}  # seq -> [code, times left]
        self._capacity_faults: dict[str, int] = {}  # site -> times left
        self._fatal_faults: dict[str, int] = {}
        self._poisoned = False

    def inject_fault(self, seq: int, code: int = int(Fault.INTERNAL), times: int = 1) -> None:
        """The next `times` steps that feed `seq` raise LaneFault(code), changing nothing."""
        self._lane_faults[seq] = [int(code), times]

    def inject_capacity_fault(self, times: int = 1, on: FaultSite = "step") -> None:
        """The next `times` calls at `on` raise CapacityError, changing nothing."""
        self._capacity_faults[self._site(on)] = times

    def inject_fatal(self, on: FaultSite = "step", times: int = 1) -> None:
        """The next call at `on` raises FatalError; the runtime is poisoned after."""
        self._fatal_faults[self._site(on)] = times

    def clear_faults(self) -> None:
        """Drop pending injections and the poison (the fake's state is intact)."""
        self._lane_faults.clear()
        self._capacity_faults.clear()
        self._fatal_faults.clear()
        self._poisoned = False

    @property
    def poisoned(self) -> bool:
        return self._poisoned

    @staticmethod
    def _site(on: str) -> str:
        if on not in _SITES:
            raise ValueError(f"fault site {on!r} not one of {sorted(_SITES)}")
        return on

    @staticmethod
    def _take(pending: dict[str, int], site: str) -> bool:
        for key in (site, "any"):
            if pending.get(key, 0) > 0:
                pending[key] -= 1
                return True
        return False

    def _alive(self) -> None:
        if self._closed:
            raise FatalError("runtime closed")
        if self._poisoned:
            raise FatalError("runtime state unknown after an earlier fatal error")

    def _injected(self, site: str, seqs: Sequence[int] = ()) -> None:
        """Raise what was injected for this call, after its checks passed."""
        if self._take(self._fatal_faults, site):
            self._poisoned = True
            self.stats.faults += 1
            raise FatalError(f"injected fatal error at {site}")
        fault = None
        for s in seqs:
            pending = self._lane_faults.get(s)
            if pending and pending[1] > 0:
                pending[1] -= 1
                fault = fault or pending[0]
        if fault is not None:
            self.stats.faults += 1
            raise LaneFault(fault, f"injected lane fault {fault}")
        if self._take(self._capacity_faults, site):
            self.stats.faults += 1
            raise CapacityError(f"injected capacity error at {site}")
