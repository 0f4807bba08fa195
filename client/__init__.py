"""Planner-side client of the superfluid ABI."""

from superfluid.client.builder import PlanBuilder, read_events, sampling_params

__all__ = ["PlanBuilder", "read_events", "sampling_params"]
