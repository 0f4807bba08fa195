"""The engine: the runtime interface, the model runtimes (transformer, Mamba2, the fake) and model loading."""

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
    UnknownSequence,
    Unsupported,
    Vocabulary,
)


def load(path, backend: str = "torch", **options):
    """Load a checkpoint into its runtime: a TransformerRuntime or a Mamba2Runtime (engine/loader.py)."""
    from superfluid.engine.loader import load as _load

    return _load(path, backend, **options)


__all__ = [
    "CapacityError",
    "FatalError",
    "Feed",
    "LaneFault",
    "MemCounters",
    "OutOfBounds",
    "Runtime",
    "RuntimeDescription",
    "RuntimeFailure",
    "SampleSpec",
    "TokenMasks",
    "UnknownSequence",
    "Unsupported",
    "Vocabulary",
    "load",
]
