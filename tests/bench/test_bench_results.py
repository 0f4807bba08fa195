"""`superfluid bench NAME --save DIR`: the result as files, and the table made from the JSON alone."""

from __future__ import annotations

import json

from superfluid.bench.results import rows
from superfluid.cli import main


def test_save_writes_the_result_and_a_table_of_it(tmp_path, capsys):
    assert main(["bench", "tick", "--ticks", "2", "--rounds", "1", "--save", str(tmp_path)]) == 0
    printed = json.loads(capsys.readouterr().out)
    record = json.loads((tmp_path / "tick.json").read_text())
    assert record["bench"] == "tick" and record["result"] == printed and record["exit_status"] == 0
    assert record["machine"]["cores"] >= 1 and len(record["load_before"]) == 3
    table = (tmp_path / "tick.md").read_text().splitlines()
    figures = [ln for ln in table if ln.startswith("| ") and not ln.startswith(("| figure", "| ---"))]
    assert figures and len(figures) == len(rows(printed))  # every row from the JSON, none typed by hand
    for (key, value), line in zip(rows(printed), figures):
        assert line == f"| {key} | {value} |"


def test_rows_take_scalars_and_one_level_of_dicts():
    got = rows({"a": 1, "b": {"x": 2.5, "deep": {"no": 1}, "s": "t"}, "c": [1, 2], "d": None})
    assert got == [("a", 1), ("b.x", 2.5), ("b.s", "t"), ("d", None)]
