"""The engine: the runtime interface, model runtimes and the plan codec."""

from superfluid.engine.runtime import (
    CapacityError,
    FatalError,
    Feed,
    LaneFault,
    MemCounters,
    OutOfBounds,
    Runtime,
    RuntimeDescription,
    RuntimeFailure,
    SampleSpec,
    TokenMasks,
    Unsupported,
    UnknownSequence,
    Vocabulary,
)


def load(path, backend: str = "torch", **options):
    """Load a checkpoint into a TransformerRuntime (see engine/loader.py)."""
    from superfluid.engine.loader import load as _load

    return _load(path, backend, **options)


__all__ = [
    "CapacityError", "FatalError", "Feed", "LaneFault", "MemCounters", "OutOfBounds", "Runtime",
    "RuntimeDescription", "RuntimeFailure", "SampleSpec", "TokenMasks", "Unsupported", "UnknownSequence",
    "Vocabulary", "load",
]
