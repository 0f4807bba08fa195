"""abi/header_types.pyi, the records and enums as a type checker sees them,
is what gen_types makes from the live classes: a header change it missed
fails here (the fix: python -P -m superfluid.abi.gen_types)."""

from __future__ import annotations

import ast
import enum
from pathlib import Path

import superfluid.abi as abi
from superfluid.abi import gen_types
from superfluid.abi.records import CLASSES, RECORD_NAMES


def test_the_stub_is_up_to_date():
    assert gen_types.main(["--check"]) == 0


def test_the_stub_states_every_record_field_and_enum_member_in_order():
    classes = {node.name: node for node in ast.parse(Path(gen_types.OUT).read_text()).body
               if isinstance(node, ast.ClassDef)}
    for name in RECORD_NAMES:
        fields = [s.target.id for s in classes[name].body if isinstance(s, ast.AnnAssign)]
        assert fields == list(CLASSES[name]._fields), name
    made = [v for v in vars(abi).values() if isinstance(v, enum.EnumMeta) and v.__module__ == abi.__name__]
    assert {"Status", "Fault", "OpKind", "PlanFlag"} <= {e.__name__ for e in made}
    for e in made:
        members = {s.targets[0].id: s.value.value for s in classes[e.__name__].body if isinstance(s, ast.Assign)}
        assert members == {k: int(v) for k, v in e.__members__.items()}, e
