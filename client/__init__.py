"""Planner-side client of the superfluid ABI: build plans (PlanBuilder), talk
to a worker (Client), and the reference planner (Planner)."""

if __name__ != "superfluid.client":  # imported by its bare name from a checkout's root: not ours
    from superfluid.checkout import not_ours

    not_ours(__name__, __file__)

from superfluid.client.builder import PlanBuilder, read_events, sampling_params
from superfluid.client.client import Client
from superfluid.client.describe import Parallel
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
                                      "Parallel",
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
