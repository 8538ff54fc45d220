"""docs/PERFORMANCE.md's step table is the archived runs' JSON, as bench/where_it_stands.py renders it."""
from __future__ import annotations

import json

import where_it_stands  # bench/ is on the path: pytest's pythonpath option (pyproject.toml)


def test_the_table_in_the_doc_is_the_archive():
    assert where_it_stands.main(["--check"]) == 0


def test_rows_carry_each_archived_figure_and_a_stale_doc_is_caught(tmp_path):
    run = {"env": {"card": "Card X"}, "settings": {"rounds": 3, "steps": 8},
           "results": [{"method": "erm", "step_ms": 800.04, "peak_gib": 20.0},
                       {"method": "iga_bf16", "step_ms": 812.26, "ratio_step": 1.01532,
                        "ratio_step_interval90": [0.98, 1.041], "ratio_peak": 1.0111, "method_ms": 14.96,
                        "boundary_other_ms": 2.04}]}
    folder = tmp_path / "results" / "x-run"
    folder.mkdir(parents=True)
    (folder / "machine-Q-bench_step_2gpu.json").write_text(json.dumps(run))
    (folder / "bench_step_2gpu.json").write_text(json.dumps(run))  # not named as archived: left out
    (folder / "machine-AB-bench_step_1gpu.json").write_text(json.dumps(run))  # after Z: two letters, listed last
    table = where_it_stands.table(tmp_path / "results")
    lines = table.splitlines()
    assert len(lines) == 6 and lines[0] == where_it_stands.HEADER
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| Q", "| Q", "| AB", "| AB"]
    lines = lines[:4]
    assert lines[2] == "| Q | Card X | 2 | 3 x 8 | erm | 800.0 | - | - | - | - | [log](results/x-run/README.md) |"
    assert lines[3] == ("| Q | Card X | 2 | 3 x 8 | iga_bf16 | 812.3 | 1.015 (0.980-1.041) | 1.011 | 15.0 | 2.0 "
                        "| [log](results/x-run/README.md) |")
    table = "\n".join(lines)
    doc = f"intro\n{where_it_stands.BEGIN}\nold table\n{where_it_stands.END}\nrest\n"
    fresh = where_it_stands.render(doc, table)
    assert fresh == f"intro\n{where_it_stands.BEGIN}\n{table}\n{where_it_stands.END}\nrest\n"
    assert where_it_stands.render(fresh, table) == fresh
