"""The executor: lanes, the tick, the prefix cache, host sampling, ops."""

from superfluid.executor.executor import Executor, ExecutorFatal, TickResult
from superfluid.executor.rings import LocalRings, TickRings

__all__ = ["Executor", "ExecutorFatal", "LocalRings", "TickResult", "TickRings"]
