"""rings/naming.py: the names sf_segment_open accepts, and where it looks."""

from __future__ import annotations

import pytest

from superfluid.rings.errors import SegmentError
from superfluid.rings.naming import parse_segment_path, segment_path


@pytest.mark.parametrize("name", ["demo\n", "", "-x", "a" * 32, "a/b", "dé"])
def test_bad_names_refused(name):
    with pytest.raises(SegmentError, match="name"):
        segment_path(name, 0)


def test_good_names_kept():
    assert segment_path("a" * 31, 65535).endswith("/superfluid." + "a" * 31 + ".65535")
    assert parse_segment_path(segment_path("demo-1.x_y", 3)) == ("demo-1.x_y", 3)


@pytest.mark.parametrize("base", ["superfluid.demo\n.0", "superfluid.demo.\u0663", "superfluid.demo.65536"])
def test_foreign_files_not_ours(base):
    assert parse_segment_path("/dev/shm/" + base) is None


def test_empty_shm_dir_is_the_default(monkeypatch):
    monkeypatch.setenv("SUPERFLUID_SHM_DIR", "")
    assert segment_path("demo", 0) == "/dev/shm/superfluid.demo.0"
    monkeypatch.setenv("SUPERFLUID_SHM_DIR", "/tmp/x")
    assert segment_path("demo", 0) == "/tmp/x/superfluid.demo.0"
