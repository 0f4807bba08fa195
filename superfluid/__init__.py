"""superfluid: a tick-based LLM executor daemon behind a C ABI over shared memory."""

__version__ = "0.1.0"
