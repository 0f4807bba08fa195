"""Shared fixtures: every test's segments live in a private directory under
/dev/shm that is checked empty and removed at the end of the session."""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, Phase, settings

# The fixture harness authors use (faulty_daemon_factory), as they would load it.
pytest_plugins = ["superfluid.testing.harness"]

# "ci" (the default): the same examples every run, so a red CI is the change's
# doing, not the draw's. "explore" (HYPOTHESIS_PROFILE=explore make test): fresh
# random examples each run, to look for what the fixed ones miss.
# Neither has the explain phase: it traces every line of a failing example again,
# which turned failures of the long stateful tests into 300 s timeouts, not reports.
_PHASES = [p for p in Phase if p != Phase.explain]
settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True,
    phases=_PHASES,
)
settings.register_profile(
    "explore", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=False,
    phases=_PHASES,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

_SHM_ROOT = "/dev/shm" if os.path.isdir("/dev/shm") else None
_counter = itertools.count()


@pytest.fixture(scope="session", autouse=True)
def shm_dir():
    d = tempfile.mkdtemp(prefix="sf-test-", dir=_SHM_ROOT)
    os.chmod(d, 0o700)
    old = os.environ.get("SUPERFLUID_SHM_DIR")
    os.environ["SUPERFLUID_SHM_DIR"] = d
    yield d
    left = os.listdir(d)
    shutil.rmtree(d, ignore_errors=True)
    if old is None:
        os.environ.pop("SUPERFLUID_SHM_DIR", None)
    else:
        os.environ["SUPERFLUID_SHM_DIR"] = old
    assert not left, f"segments left behind: {left}"


@pytest.fixture
def seg_name(request) -> str:
    """A segment name unique within the session."""
    return f"t{os.getpid()}-{next(_counter)}"


@pytest.fixture
def segment(seg_name):
    """A fresh segment with small queues and rings, unlinked afterwards."""
    from superfluid.rings.layout import SegmentConfig
    from superfluid.rings.segment import Segment

    cfg = SegmentConfig(plan_slots=4, plan_slot_bytes=4096, event_slots=4, event_slot_bytes=8192, op_slots=4,
                        op_slot_bytes=1024, stream_slots=16, stream_slot_bytes=64, prompt_tokens=64,
                        emit_tokens=64, logits_floats=256)
    seg = Segment.create(seg_name, 0, cfg)
    yield seg
    seg.close()
    seg.unlink()
