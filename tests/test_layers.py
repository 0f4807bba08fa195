"""The import rule (docs/architecture.md §1): a lower layer never imports a
higher one, and the daemon takes of the executor only what superfluid.executor
exports. Read from the source (every import statement, also those inside
functions and under TYPE_CHECKING), not from what one run happens to load."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import superfluid
import superfluid.executor

ROOT = Path(superfluid.__file__).resolve().parent.parent
ORDER = ["abi", "rings", "kernels", "engine", "executor", "daemon", "client"]
RANK = {name: i for i, name in enumerate(ORDER)}
TOP = len(ORDER)  # superfluid's own modules (cli, bench, demo, testing) and fuzz: above every folder
BOTTOM = {"checkout": -1}  # what every folder's __init__ uses when imported by its bare name


def imports(source: str, package: str) -> list[tuple[int, str]]:
    """(line, module) of every superfluid.* import in source, a module of
    `package` (relative imports resolved against it)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("superfluid.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            elif node.module == "superfluid" or (node.module or "").startswith("superfluid."):
                mod = node.module
            else:
                continue
            if mod.count(".") <= 1 or not node.module:  # from superfluid[.pkg] (or .) import mod: modules
                out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, mod))
    return out


def rank_of(module: str) -> int | None:
    """The layer of a superfluid.* module (None: the package root itself)."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    return BOTTOM.get(parts[1], RANK.get(parts[1], TOP))


def sources(folder: str) -> list[tuple[str, list[tuple[int, str]]]]:
    out = []
    for p in sorted((ROOT / folder).rglob("*.py")):
        package = ".".join(["superfluid", *p.relative_to(ROOT).parts[:-1]])
        out.append((str(p.relative_to(ROOT)), imports(p.read_text(), package)))
    assert out, folder
    return out


def upward(folder: str, found: list[tuple[str, list[tuple[int, str]]]]) -> list[str]:
    return [f"{name}:{line} imports {m}" for name, got in found for line, m in got
            if (r := rank_of(m)) is not None and r > RANK[folder]]


@pytest.mark.parametrize("folder", ORDER)
def test_no_lower_layer_imports_a_higher_one(folder):
    assert upward(folder, sources(folder)) == []


def unexported(found: list[tuple[str, list[tuple[int, str]]]]) -> list[str]:
    return [f"{name}:{line} imports {m}" for name, got in found for line, m in got
            if m.startswith("superfluid.executor.") and m.split(".")[2] not in superfluid.executor.__all__]


def test_the_daemon_uses_only_what_the_executor_exports():
    assert unexported(sources("daemon")) == []


def test_the_rule_sees_wrong_imports():
    """Negative control: an upward import, absolute, relative or inside a
    function, is found and named."""
    src = ("from superfluid.engine import runtime\n"
           "def f():\n    from ...engine.kv import KVPool\n    import superfluid.daemon.worker\n"
           "from . import errors\n")
    got = imports(src, "superfluid.rings.sub")
    assert got == [(1, "superfluid.engine.runtime"), (5, "superfluid.rings.sub.errors"),
                   (3, "superfluid.engine.kv"), (4, "superfluid.daemon.worker")]
    assert len(upward("rings", [("x.py", got)])) == 3
    top = imports("from superfluid import executor, testing as t\nimport superfluid.bench.tick\n", "superfluid.engine")
    assert [m for _, m in top] == ["superfluid.executor", "superfluid.testing", "superfluid.bench.tick"]
    assert len(upward("engine", [("y.py", top)])) == 3
    inner = imports("from superfluid.executor.tick import Tick\nfrom superfluid.executor import Executor\n",
                    "superfluid.daemon")
    assert unexported([("z.py", inner)]) == ["z.py:1 imports superfluid.executor.tick"]
