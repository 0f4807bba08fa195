"""A tick's part in fault injection (faults.py): the lane faults a fault
schedule's token rules cause, and NUMERIC faults of rows that are not
finite (injected or not)."""

from __future__ import annotations

from superfluid.abi import Fault
from superfluid.engine.runtime import FatalError
from superfluid.executor.faults import INJECTED
from superfluid.executor.lanes import Lane
from superfluid.executor.tick_state import TickState


class FaultPhase(TickState):
    def numeric_fault(self, lane: Lane, remaining: dict[int, int]) -> None:
        """The lane's row was not finite: it faults NUMERIC (marked injected
        where a fault schedule made the row NaN)."""
        fr = self.ex.fault_rt
        injected = fr is not None and lane.seq in fr.poisoned
        self.fault(lane.tag, Fault.NUMERIC, INJECTED if injected else 0)
        remaining.pop(lane.tag, None)

    def token_rules(self, lane: Lane, remaining: dict[int, int]) -> bool:
        """A fault schedule's token rules for the token the lane is about to
        take (faults.py); True when the lane faulted instead."""
        ex = self.ex
        assert ex.faults is not None and ex.fault_rt is not None
        try:
            code = ex.faults.on_token(ex, lane, ex.fault_rt)
        except FatalError as e:
            raise ex.fatal("a decode step", e) from e
        if code is None:
            return False
        self.fault(lane.tag, code, INJECTED)
        remaining.pop(lane.tag, None)
        return True
