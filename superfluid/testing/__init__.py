"""Test support: the suite's helpers, importable without the repository root
on sys.path, and usable by a harness that drives superfluid in its own tests
(live daemons, model planners, runtime conformance checks). Needs the `test`
extra (pytest, hypothesis)."""
