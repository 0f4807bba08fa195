"""Planner-side client of the superfluid ABI: build plans (PlanBuilder), talk
to a worker (Client), and the reference planner (Planner)."""

from superfluid.client.builder import PlanBuilder, read_events, sampling_params
from superfluid.client.client import (Client, ClientError, ClientTimeout, DaemonGone, WorkerGaveUp, WorkerRestarted,
                                      WorkerTaken)
from superfluid.client.planner import (GPU_GREEDY, GPU_SAMPLE, HOST, Planner, PlannerError, PlannerStats,
                                       Report, RequestResult)

__all__ = [
    "PlanBuilder", "read_events", "sampling_params",
    "Client", "ClientError", "ClientTimeout", "DaemonGone", "WorkerGaveUp", "WorkerRestarted", "WorkerTaken",
    "Planner", "PlannerError", "PlannerStats", "Report", "RequestResult", "GPU_GREEDY", "GPU_SAMPLE", "HOST",
]
