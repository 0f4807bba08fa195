"""Planner-side client of the superfluid ABI: build plans (PlanBuilder), talk
to a worker (Client), and the reference planner (Planner)."""

from superfluid.client.builder import PlanBuilder, read_events, sampling_params
from superfluid.client.client import Client
from superfluid.client.planner import (
                                      GPU_GREEDY,
                                      GPU_SAMPLE,
                                      HOST,
                                      Planner,
                                      PlannerError,
)
from superfluid.client.planner_state import PlannerStats, Report, RequestResult
from superfluid.client.session import (
                                      ClientError,
                                      ClientTimeout,
                                      DaemonGone,
                                      WorkerGaveUp,
                                      WorkerRestarted,
                                      WorkerTaken,
)

__all__ = [
                                      "GPU_GREEDY",
                                      "GPU_SAMPLE",
                                      "HOST",
                                      "Client",
                                      "ClientError",
                                      "ClientTimeout",
                                      "DaemonGone",
                                      "PlanBuilder",
                                      "Planner",
                                      "PlannerError",
                                      "PlannerStats",
                                      "Report",
                                      "RequestResult",
                                      "WorkerGaveUp",
                                      "WorkerRestarted",
                                      "WorkerTaken",
                                      "read_events",
                                      "sampling_params",
]
