"""The executor: lanes, the tick, the prefix cache, host sampling, ops.

What a worker (daemon/) uses is exported here; the modules below are the
executor's own."""

if __name__ != "superfluid.executor":  # imported by its bare name from a checkout's root: not ours
    from superfluid.checkout import not_ours

    not_ours(__name__, __file__)

from superfluid.executor.executor import Executor, ExecutorFatal, TickResult
from superfluid.executor.faults import KINDS as FAULT_KINDS, FaultSchedule, parse_schedule
from superfluid.executor.op_fields import OpError  # what StateDir and parse_schedule raise
from superfluid.executor.speculation import MAX_SLOTS as SPEC_SLOTS
from superfluid.executor.speculation_gate import MAX_BUCKET as SPEC_MAX_BUCKET
from superfluid.executor.state_dir import StateDir
from superfluid.executor.tick_rings import LocalRings, TickRings

__all__ = ["FAULT_KINDS", "SPEC_MAX_BUCKET", "SPEC_SLOTS", "Executor", "ExecutorFatal", "FaultSchedule", "LocalRings",
           "OpError", "StateDir", "TickResult", "TickRings", "parse_schedule"]
