"""Tensor parallelism: one model on several rank processes, the same bits at every degree."""
