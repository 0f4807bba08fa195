"""Where a worker's segment lives: one file per worker, named by its
daemon's name and the worker's index (contract §1.1)."""

from __future__ import annotations

import os
import re

from superfluid.rings.errors import SegmentError

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,30}\Z")  # \Z: no name ends in a newline


def shm_dir() -> str:
    """Where segments live: $SUPERFLUID_SHM_DIR, else (unset or empty) /dev/shm, as sf_segment_open."""
    return os.environ.get("SUPERFLUID_SHM_DIR") or "/dev/shm"


def segment_path(name: str, index: int) -> str:
    if not NAME_RE.match(name):
        raise SegmentError(f"name {name!r}: 1-31 characters of [A-Za-z0-9_.-], starting with a letter or digit")
    if not 0 <= index < 1 << 16:
        raise SegmentError(f"worker index {index}: must be in [0, 65536)")
    return os.path.join(shm_dir(), f"superfluid.{name}.{index}")


def parse_segment_path(path: str) -> tuple[str, int] | None:
    """(name, index) of a path segment_path made, else None."""
    base = os.path.basename(path)
    if not base.startswith("superfluid."):
        return None
    name, _, index = base[len("superfluid."):].rpartition(".")
    if not NAME_RE.match(name) or not (index.isascii() and index.isdigit()) or int(index) >= 1 << 16:
        return None
    return name, int(index)

