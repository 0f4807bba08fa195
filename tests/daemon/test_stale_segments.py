"""Which files in the segment folder are a daemon's: only names segment_path
makes. Anyone may create files there; one of another shape must neither stop
a daemon's start nor be removed by it."""

from __future__ import annotations

import os

from superfluid.daemon.segment_ownership import remove_stale_segments
from superfluid.daemon.status import segment_paths


def test_only_names_segment_path_makes_are_ours(tmp_path, monkeypatch):
    monkeypatch.setenv("SUPERFLUID_SHM_DIR", str(tmp_path))
    ours = {i: tmp_path / f"superfluid.demo.{i}" for i in (0, 3)}
    foreign = ["superfluid.demo.\u00b2", "superfluid.demo.\u0663", "superfluid.demo.65536", "superfluid.demo.1x",
               "superfluid.demo.", "superfluid.demo.2.bak", "superfluid.demox.1"]
    for p in ours.values():
        p.write_bytes(b"")
    for f in foreign:
        (tmp_path / f).write_bytes(b"")
    assert segment_paths("demo") == [(0, str(ours[0])), (3, str(ours[3]))]
    remove_stale_segments("demo", 2)  # index 3 is past 2 workers: stale
    assert sorted(os.listdir(tmp_path)) == sorted(["superfluid.demo.0", *foreign])
