"""The engine: the runtime interface, the model runtimes (transformer, Mamba2, the fake) and model loading."""

if __name__ != "superfluid.engine":  # imported by its bare name from a checkout's root: not ours
    from superfluid.checkout import not_ours

    not_ours(__name__, __file__)

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
