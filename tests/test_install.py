"""What a fresh machine gets: the repository root is never an import root, and
the versions installed are the lock's.

The root holds folders named kernels/, engine/, abi/, ...: the package's
subpackages, reached as superfluid.* through the install. Were the root on
sys.path, each would shadow any installed package of its name; transformers
imports Hugging Face's `kernels`, and the whole HF oracle suite went red the
day it began to. Each way the project starts Python from the checkout is
probed here from the root, with a negative control (a plain `python -c`,
which does put the working directory first) showing the probe sees shadowing
when there is some."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from superfluid.bench import gpu_check
from superfluid.testing.launch import python

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "constraints.txt"
# Every top-level folder Python could import by name, but our own package's.
FOLDERS = sorted(d.name for d in ROOT.iterdir()
                 if d.is_dir() and d.name.isidentifier() and d.name != "superfluid")
PACKAGES = [d for d in FOLDERS if (ROOT / d / "__init__.py").is_file()]

PROBE = r"""
import importlib, json, sys
out = {"path0": sys.path[0] if sys.path else None}
if sys.argv[1] == "transformers":
    import transformers.activations  # imports HF's kernels where it is installed
    import superfluid.kernels
    mod = sys.modules.get("kernels")
    out["kernels"] = getattr(mod, "__file__", None)
    out["superfluid.kernels"] = superfluid.kernels.__file__
else:
    for name in sys.argv[2:]:
        mod = importlib.import_module(name)
        out[name] = getattr(mod, "THROWAWAY", None) and mod.__file__
        # A namespace portion (a folder without __init__) has no __file__: not the throwaway.
print(json.dumps(out))
"""


def _env(**extra: str) -> dict[str, str]:
    """This environment less PYTHONSAFEPATH (so that each launcher's own flags are what is tested)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    env.update(extra)
    return env


def _make_prefix() -> list[str] | None:
    """Python as the Makefile's targets start it (make test, make gpu-check: both `$(PY)`,
    with what the Makefile exports), or None where make or this venv's layout is missing."""
    if shutil.which("make") is None or not (Path(sys.prefix) / "bin" / "python").exists():
        return None
    return ["make", "-s", "--no-print-directory", "-C", str(ROOT), f"VENV={sys.prefix}",
            "--eval", "sf-probe:\n\t@$(PY) -c \"$$SF_PROBE\" $$SF_PROBE_ARGS", "sf-probe"]


def _run(launch: str, mode: str, names: list[str], env: dict[str, str]) -> dict:
    if launch == "make":
        prefix = _make_prefix()
        if prefix is None:
            pytest.skip("no make, or not running in a venv")
        argv = prefix
        env = dict(env, SF_PROBE=PROBE, SF_PROBE_ARGS=" ".join([mode, *names]))
    else:
        head = {"suite": python(), "gpu-check": gpu_check.parts()[0][1][:2],
                "plain": [sys.executable]}[launch]
        argv = [*head, "-c", PROBE, mode, *names]
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{launch}: {argv}\n{r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_suite_has_no_root_on_sys_path():
    on_path = [p for p in sys.path if Path(p or os.getcwd()).resolve() == ROOT]
    assert not on_path, f"the repository root is on sys.path: {sys.path}"
    spec = importlib.util.find_spec("kernels")
    assert spec is None or not Path(spec.origin or "").resolve().is_relative_to(ROOT / "kernels"), spec


def test_gpu_check_starts_its_parts_with_a_safe_path():
    for name, argv, _, _ in gpu_check.parts():
        assert argv[:2] == [sys.executable, "-P"], (name, argv)


# "plain": `python -c` from the root, which puts the root first on sys.path: the
# folders' __init__ step aside for installed packages of their names (superfluid/checkout.py).
@pytest.mark.parametrize("launch", ["suite", "gpu-check", "make", "plain"])
def test_transformers_gets_its_kernels_and_we_get_ours(launch):
    pytest.importorskip("transformers")
    if importlib.util.find_spec("kernels") is None:
        pytest.skip("Hugging Face's kernels is not installed")
    out = _run(launch, "transformers", [], _env())
    assert out["kernels"] and not Path(out["kernels"]).resolve().is_relative_to(ROOT / "kernels"), out
    assert Path(out["superfluid.kernels"]).resolve() == ROOT / "kernels" / "__init__.py", out


@pytest.fixture(scope="module")
def throwaways(tmp_path_factory) -> Path:
    """A folder of installed distributions, one named like each top-level folder of the repository."""
    site = tmp_path_factory.mktemp("site")
    for name in FOLDERS:
        (site / name).mkdir()
        (site / name / "__init__.py").write_text("THROWAWAY = True\n")
        info = site / f"{name}-0.0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.1\n")
        (info / "RECORD").write_text("")
    return site


@pytest.mark.parametrize("launch", ["suite", "gpu-check", "make", "plain"])
def test_an_installed_package_named_like_a_top_level_folder_is_the_one_found(launch, throwaways):
    assert {"kernels", "engine", "abi"} <= set(PACKAGES), PACKAGES  # the names that matter are probed
    out = _run(launch, "names", FOLDERS, _env(PYTHONPATH=str(throwaways)))
    shadowed = [n for n in FOLDERS if not out[n] or not Path(out[n]).is_relative_to(throwaways)]
    assert not shadowed, f"{launch}: the repository's {shadowed} were imported (sys.path[0]: {out['path0']})"


def test_a_folder_named_like_nothing_installed_is_not_importable_by_its_bare_name():
    r = subprocess.run([sys.executable, "-c", "import engine"], cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1 and "ModuleNotFoundError: No module named 'engine'" in r.stderr, r.stderr


def test_negative_control_a_folder_without_the_guard_shadows(tmp_path, throwaways):
    """The probe sees shadowing where it happens: a checkout-like root whose
    kernels/ lacks the guard wins over the installed kernels under `python -c`."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    r = subprocess.run([sys.executable, "-c", PROBE, "names", "kernels"], cwd=tmp_path,
                       env=_env(PYTHONPATH=str(throwaways)), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["kernels"] is None  # not the throwaway


# ------------------------------------------------------------------ the lock


def _pins() -> dict[str, Version]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


def _wanted() -> list[Requirement]:
    """pyproject.toml's requirements that make installs: the package's, its test and triton extras,
    and the setup group."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = meta["project"]["dependencies"] + meta["dependency-groups"]["setup"]
    for extra in ("test", "triton"):
        reqs += meta["project"]["optional-dependencies"][extra]
    return [Requirement(r) for r in reqs]


def test_the_lock_pins_every_requirement_at_a_version_it_allows():
    pins = _pins()
    assert LOCK.read_text().startswith("# This file was autogenerated by uv"), "made by `make lock`"
    for req in _wanted():
        if req.marker is not None and not req.marker.evaluate():
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"{req} is not in {LOCK.name}: run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), f"the lock's {name} {pins[name]}: not {req}"


def test_what_is_installed_is_what_the_lock_pins():
    wrong = []
    for name, pin in _pins().items():
        try:
            have = Version(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            continue  # e.g. CUDA's packages on a CPU machine
        if Version(have.public) != pin:  # torch 2.13.0+cpu is the lock's 2.13.0
            wrong.append(f"{name} {have} (lock: {pin})")
    assert not wrong, f"installed versions differ from {LOCK.name} (make setup installs the lock's): {wrong}"
