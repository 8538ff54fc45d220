"""docs/PERFORMANCE.md's table is the archived runs' JSON, as bench/perf_table.py renders it."""
from __future__ import annotations

import json

import pytest

import perf_table  # bench/ is on the path: pytest's pythonpath option (pyproject.toml)


def test_the_table_in_the_doc_is_the_archive():
    text = perf_table.DOC.read_text(encoding="utf-8")
    assert perf_table.render(text, perf_table.table()) == text, "run python bench/perf_table.py --write"


def _step_run(card: str, ratio: float) -> dict:
    return {"env": {"card": card}, "settings": {"rounds": 2, "steps": 8},
            "results": [{"method": "erm", "step_ms": 800.0},
                        {"method": "iga_bf16_q1p16", "step_ms": 800.0 * ratio, "ratio_step": ratio,
                         "ratio_step_interval90": [0.9, 1.1], "ratio_peak": 1.0111, "method_ms": 14.96,
                         "boundary_other_ms": 2.04}]}


def _archive(root, index_rows: list[str], files: dict[str, dict]):
    root.mkdir()
    (root / "README.md").write_text("| campaign | archived | commit | what | feeds |\n|---|---|---|---|---|\n"
                                    + "".join(f"{row}\n" for row in index_rows))
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(json.dumps(content))


def test_the_latest_campaign_per_card_and_benchmark_gives_the_rows(tmp_path):
    results = tmp_path / "results"
    _archive(results, ["| [old](old/) | 2026-01-01 10:00 | aaaaaaa | x | y |",
                       "| [new](new/) | 2026-01-02 10:00 | bbbbbbb | x | y |"],
             {"old/machine-A-bench_step_1gpu.json": _step_run("Card X", 0.5),
              "old/machine-A-bench_step_2gpu.json": _step_run("Card X", 0.7),
              "new/machine-B-bench_step_1gpu.json": _step_run("Card X", 1.01532),
              "new/machine-C-bench_step_1gpu.json": _step_run("Card X", 0.99),
              "new/machine-C-bench_step_1gpu_variant.json": _step_run("Card X", 3.0),  # not the benchmark's name
              "new/machine-D-bench_step_1gpu.json": _step_run("Card Y", 0.98)})
    lines = perf_table.table(results).splitlines()
    assert lines[0] == perf_table.HEADER and len(lines) == 6
    assert lines[2] == ("| Card X | step, 1 GPU | `iga_bf16_q1p16`: step / ERM 1.015 (0.900-1.100), peak / ERM 1.011, "
                        "method 15.0 ms, other 2.0 ms (2 x 8 steps) | [new](../results/new/), machine B | 2026-01-02 10:00, bbbbbbb |")
    assert "step / ERM 0.990" in lines[3] and lines[3].endswith("| [new](../results/new/), machine C | 2026-01-02 10:00, bbbbbbb |")
    assert lines[4].startswith("| Card X | step, 2 GPUs | `iga_bf16_q1p16`: step / ERM 0.700") and "[old]" in lines[4]
    assert lines[5].startswith("| Card Y | step, 1 GPU |")
    doc = f"intro\n{perf_table.BEGIN}\nold table\n{perf_table.END}\nrest\n"
    fresh = perf_table.render(doc, "\n".join(lines))
    assert fresh == f"intro\n{perf_table.BEGIN}\n" + "\n".join(lines) + f"\n{perf_table.END}\nrest\n"
    assert perf_table.render(fresh, "\n".join(lines)) == fresh


def test_a_run_outside_the_index_is_refused(tmp_path):
    results = tmp_path / "results"
    _archive(results, [], {"unlisted/bench_step_1gpu.json": _step_run("Card X", 1.0)})
    with pytest.raises(SystemExit, match="unlisted"):
        perf_table.table(results)


def _train_run(card: str) -> dict:
    row = lambda name, tps, mfu: {"variant": name, "tokens_per_s": tps, "median_step_s": 1.0, "mfu": mfu}
    return {"benchmark": "bench_train", "card": card, "settings": {"shape": "smollm2-135m", "steps": 120,
                                                                    "warmup_steps": 10, "model_dir": "/x/model"},
            "variants": [row("torch", 10000.0, 0.01), row("hf_trainer", 8000.0, None),
                         row("iga_ds_iga", 12000.0, 0.012), {"variant": "iga_ds_erm", "error": "boom"}]}


def test_training_throughput_rows_compare_the_trainer_with_its_anchors(tmp_path):
    results = tmp_path / "results"
    _archive(results, ["| [t](t/) | 2026-01-03 10:00 | ccccccc | x | y |"],
             {"t/machine-A-bench_train_smollm2.json": _train_run("Card Z")})
    lines = perf_table.table(results).splitlines()
    assert lines[2] == ("| Card Z | training, smollm2-135m | `torch` 10,000 tokens/s, MFU 1.0%; `hf_trainer` 8,000 tokens/s; "
                        "`iga_ds_iga` 12,000 tokens/s, 1.50x HF Trainer, 1.20x plain loop, MFU 1.2%; not run: iga_ds_erm "
                        "(120 steps, 10 left out) | [t](../results/t/), machine A | 2026-01-03 10:00, ccccccc |")


def test_a_training_row_gives_the_paired_iga_over_erm_step_when_the_run_has_it(tmp_path):
    results = tmp_path / "results"
    run = _train_run("Card Z")
    run["paired"] = [{"variant": "iga_ds_iga", "baseline": "torch", "step_ratio": 0.8, "interval90": [0.7, 0.9]},
                     {"variant": "iga_ds_iga", "baseline": "iga_ds_erm", "step_ratio": 1.0254, "interval90": [0.99, 1.061]},
                     {"variant": "iga_ds_iga_packed_liger", "baseline": "iga_ds_erm_packed_liger", "step_ratio": 1.04,
                      "interval90": [1.01, 1.07]},
                     {"variant": "iga_ds_iga_liger", "baseline": "iga_ds_iga", "step_ratio": 0.7, "interval90": [0.6, 0.8]}]
    _archive(results, ["| [t](t/) | 2026-01-03 10:00 | ccccccc | x | y |"], {"t/bench_train_smollm2.json": run})
    row = perf_table.table(results).splitlines()[2]
    assert ("MFU 1.2%; IGA / ERM step 1.025 (0.990-1.061) paired; IGA / ERM packed liger step 1.040 (1.010-1.070) "
            "paired; not run: iga_ds_erm") in row
    assert "0.800" not in row and "0.700" not in row  # only IGA against its ERM: the anchors are in tokens/s already
    assert "| [t](../results/t/) |" in row  # a file without a machine prefix names none


def test_a_training_row_counts_the_rounds_its_steps_ran_in(tmp_path):
    results = tmp_path / "results"
    run = _train_run("Card Z")
    for row in run["variants"]:
        row["rounds"] = 2
    _archive(results, ["| [t](t/) | 2026-01-03 10:00 | ccccccc | x | y |"], {"t/A_bench_train_smollm2.json": run})
    row = perf_table.table(results).splitlines()[2]
    assert "(2 rounds of 120 steps, 10 left out of each) | [t](../results/t/), machine A |" in row
