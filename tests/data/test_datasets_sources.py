"""Isomer sets and benchmarks through `datasets`: Parquet, Arrow, save_to_disk folders and hub ids
read with the same checks as JSON Lines (errors name the source and the row), `iga-ds data export`
writes them atomically, MATH reads a Parquet copy, and every benchmark reads one dataset of its
records (Parquet, Arrow, a save_to_disk folder, a hub id) into the items of its published layout."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from iga_ds.cli import main
from iga_ds.data.schema import read_isomer_jsonl
from iga_ds.data.sources import RecordSource, dataset_of, is_hub_dataset_id, resolve_source, write_dataset
from iga_ds.data.synth import generate_groups
from iga_ds.errors import DataError, UserError
from iga_ds.evaluation.records import read_isomer_records
from iga_ds.files import write_jsonl

REPO = Path(__file__).resolve().parents[2]
BENCHMARK_FIXTURES = REPO / "tests" / "fixtures" / "benchmarks"
MATH_FIXTURE = BENCHMARK_FIXTURES / "MATH"


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    """Parquet files are converted into the datasets cache: a fresh one per test."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


@pytest.fixture
def isomers(tmp_path) -> tuple[Path, list[dict]]:
    """A generated set with dag, meta (nested, differing keys) and cue fields, as JSON Lines."""
    path = tmp_path / "set.jsonl"
    write_jsonl(path, generate_groups(4, seed=3, shortcut=0.5))
    return path, read_isomer_jsonl(path)


def _records_without(records: list[dict], index: int, **changes) -> list[dict]:
    out = [dict(r) for r in records]
    out[index].update(changes)
    return out


@pytest.mark.parametrize("fmt, name", [("parquet", "set.parquet"), ("dataset", "saved"), ("jsonl", "again.jsonl")])
def test_export_writes_a_set_that_reads_back_equal_and_validates(isomers, tmp_path, capsys, fmt, name):
    path, records = isomers
    out = tmp_path / name
    assert main(["data", "export", str(path), "--out", str(out), "--format", fmt]) == 0
    assert f"{out}: {len(records)} records, 4 groups ({fmt})" in capsys.readouterr().out
    assert read_isomer_jsonl(out) == records  # dag and meta come back as they were, not Arrow structs
    assert main(["data", "validate", str(out)]) == 0
    assert "4 groups, 16 instances" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary left


def test_arrow_files_stream_and_file_format(isomers, tmp_path):
    import pyarrow as pa
    import pyarrow.feather as feather

    path, records = isomers
    write_dataset(records, tmp_path / "saved", "dataset")
    stream = tmp_path / "stream.arrow"
    shutil.copy(next((tmp_path / "saved").glob("*.arrow")), stream)  # the IPC stream format datasets writes
    assert read_isomer_jsonl(stream) == records
    plain = tmp_path / "file.arrow"  # the IPC file format (Feather v2), as pandas or pyarrow write it
    feather.write_feather(pa.Table.from_pylist([{k: v for k, v in r.items() if k not in ("dag", "meta")}
                                                for r in records]), str(plain))
    assert read_isomer_jsonl(plain) == [{k: v for k, v in r.items() if k not in ("dag", "meta")} for r in records]


def test_struct_columns_are_read_as_objects(isomers, tmp_path):
    """A Parquet file written elsewhere, with meta as an Arrow struct: read and checked."""
    path, records = isomers
    out = tmp_path / "structs.parquet"
    plain = [{k: v for k, v in r.items() if k != "dag"} for r in records]
    import datasets

    datasets.Dataset.from_list(plain).to_parquet(str(out))
    got = read_isomer_jsonl(out)
    assert [r["problem"] for r in got] == [r["problem"] for r in records]
    assert got[0]["meta"]["pattern"] == records[0]["meta"]["pattern"]


def _bad_parquet(tmp_path: Path, records: list[dict], name: str) -> Path:
    out = tmp_path / name
    dataset_of(records).to_parquet(str(out))
    return out


def test_errors_name_the_source_and_the_row(isomers, tmp_path, capsys):
    _, records = isomers
    empty = _bad_parquet(tmp_path, _records_without(records, 2, problem="  "), "empty.parquet")
    with pytest.raises(DataError) as info:
        read_isomer_jsonl(empty)
    assert str(info.value).startswith(f"{empty}: row 2: field 'problem' is empty")
    dup = _bad_parquet(tmp_path, _records_without(records, 5, domain=records[4]["domain"]), "dup.parquet")
    with pytest.raises(DataError, match=r"dup.parquet: row 5: field 'domain': group .* instance \(row 4\)"):
        read_isomer_jsonl(dup)
    bad_json = _bad_parquet(tmp_path, records, "meta.parquet")
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(bad_json)
    metas = table.column("meta").to_pylist()
    metas[3] = "{not json"
    pq.write_table(table.set_column(table.column_names.index("meta"), "meta", pa.array(metas)), bad_json)
    with pytest.raises(DataError, match=r"meta.parquet: row 3: field 'meta': not valid JSON text"):
        read_isomer_jsonl(bad_json)
    # the command line: one line, exit 2
    assert main(["data", "validate", str(empty)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("iga-ds: error: ") and err.count("\n") == 1 and "row 2" in err


def test_leak_between_a_parquet_and_a_jsonl_file_names_both(isomers, tmp_path, capsys):
    path, records = isomers
    copy = _bad_parquet(tmp_path, records, "copy.parquet")
    assert main(["data", "validate", str(path), str(copy)]) == 2
    err = capsys.readouterr().err
    assert f"{copy}: row 0: field 'seed_id'" in err and f"is also in {path}:1" in err


def test_not_a_parquet_file_and_folders_that_are_not_datasets(tmp_path):
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"junk.parquet: not a readable Parquet file"):
        read_isomer_jsonl(tmp_path / "junk.parquet")
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match=r"folder: is a directory, expected a JSONL, Parquet or Arrow file"):
        read_isomer_jsonl(tmp_path / "folder")


def test_a_dataset_dict_folder_asks_for_a_split(isomers, tmp_path):
    import datasets

    _, records = isomers
    datasets.DatasetDict({"train": dataset_of(records), "test": dataset_of(records[:4])}).save_to_disk(
        str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"dd: a dataset with the splits test, train; name one split's folder"):
        read_isomer_jsonl(tmp_path / "dd")
    assert len(read_isomer_jsonl(tmp_path / "dd" / "train")) == len(records)


def test_hub_ids_are_spelled_apart_from_paths(tmp_path):
    assert is_hub_dataset_id("acme/isomers") and is_hub_dataset_id("acme/isomers@v1.0:test")
    for path in ("data/train.jsonl", "data/train.parquet", "a/b/c", "/abs/path", "acme/../x", "train.jsonl"):
        assert not is_hub_dataset_id(path), path
    source = resolve_source("acme/isomers@v2:test")
    assert (source.kind, source.location, source.revision, source.split) == ("hub", "acme/isomers", "v2", "test")
    assert resolve_source("acme/isomers").split == "train"
    with pytest.raises(DataError, match=r"data/train.jsonl: no such file"):
        resolve_source("data/train.jsonl")  # a missing file of that spelling is never a hub id
    assert RecordSource("hub", "acme/x", "acme/x").where(3) == "acme/x: row 3"


def test_data_train_keeps_a_hub_id_and_resolves_a_missing_file(tmp_path):
    from iga_ds.config.run import load_run_config

    (tmp_path / "conf").mkdir()
    run = tmp_path / "conf" / "run.yaml"
    run.write_text("data:\n  train: acme/isomers@v1:train\n")
    assert load_run_config(run).data.train == "acme/isomers@v1:train"
    run.write_text("data:\n  train: data/missing.parquet\n")
    assert load_run_config(run).data.train == str(tmp_path / "conf" / "data" / "missing.parquet")


@pytest.mark.slow
def test_a_hub_id_offline_is_one_line_exit_2(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "cache"))
    run = subprocess.run([sys.executable, "-m", "iga_ds", "data", "validate", "acme/isomers:test"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
    assert run.stderr.startswith("iga-ds: error: acme/isomers:test: ") and "HF_HUB_OFFLINE" in run.stderr


def test_export_is_atomic_and_replaces_only_a_saved_dataset(isomers, tmp_path, monkeypatch):
    import datasets

    path, records = isomers
    out = tmp_path / "saved"
    write_dataset(records[:8], out, "dataset")

    def broken(self, target, *args, **kwargs):
        Path(target).mkdir()
        (Path(target) / "half").write_text("x")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", broken)
    with pytest.raises(OSError):
        write_dataset(records, out, "dataset")
    monkeypatch.undo()
    assert len(read_isomer_jsonl(out)) == 8  # the earlier set stays whole
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    write_dataset(records, out, "dataset")  # a saved dataset is replaced
    assert len(read_isomer_jsonl(out)) == len(records)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(UserError, match="save_to_disk did not write"):
        write_dataset(records, tmp_path / "mine", "dataset")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_training_and_evaluation_read_the_other_formats(isomers, tmp_path):
    from iga_ds.train.batching import read_records

    path, records = isomers
    saved = write_dataset(records, tmp_path / "saved", "dataset")
    assert read_records(saved) == records
    assert read_isomer_records(saved) == records
    bad = _bad_parquet(tmp_path, _records_without(records, 6, answer=""), "noanswer.parquet")
    with pytest.raises(DataError, match=r"noanswer.parquet: row 6: missing field 'answer'"):
        read_isomer_records(bad)
    with pytest.raises(DataError, match=r"nowhere.parquet: data file not found \(data.train\)"):
        read_records(tmp_path / "nowhere.parquet")


# -- MATH from a Parquet copy ----------------------------------------------------------------


def _math_parquet_copy(root: Path, split: str = "test") -> Path:
    """The fixture's JSON files as <subject>/<split>-00000-of-00001.parquet, the hub copies' layout."""
    import datasets

    for folder in sorted((MATH_FIXTURE / "test").iterdir()):
        rows = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"), key=lambda p: (len(p.stem), p.stem))]
        (root / folder.name).mkdir(parents=True)
        datasets.Dataset.from_list(rows).to_parquet(str(root / folder.name / f"{split}-00000-of-00001.parquet"))
    return root


def test_math_reads_a_parquet_copy_like_the_json_files(tmp_path):
    from iga_ds.data.benchmarks import load_benchmark

    root = _math_parquet_copy(tmp_path / "hub-copy")
    want = load_benchmark("math", MATH_FIXTURE)
    got = load_benchmark("math", root)
    strip = [(i.problem, i.answer, i.domain, i.split, i.meta["level"]) for i in want]
    assert [(i.problem, i.answer, i.domain, i.split, i.meta["level"]) for i in got] == strip
    assert got[0].id == "math/test/algebra/0" and len({i.id for i in got}) == len(got)
    assert len(load_benchmark("math", root, levels=[1])) == len(load_benchmark("math", MATH_FIXTURE, levels=[1]))


def test_math_parquet_rows_are_checked_and_missing_subjects_reported(tmp_path):
    import datasets

    from iga_ds.data.benchmarks import load_benchmark

    root = _math_parquet_copy(tmp_path / "hub-copy")
    bad = root / "geometry" / "test-00000-of-00001.parquet"
    datasets.Dataset.from_list([{"problem": "p", "solution": r"\boxed{1}"},
                                {"problem": "q", "solution": "no box"}]).to_parquet(str(bad))
    with pytest.raises(DataError, match=r"geometry/test-00000-of-00001.parquet: row 1: field 'solution'"):
        load_benchmark("math", root)
    shutil.rmtree(root / "geometry")
    with pytest.raises(DataError, match=r"no test/geometry/ folder and no geometry/test-\*.parquet"):
        load_benchmark("math", root)


# -- every benchmark from one dataset of its records -----------------------------------------

DATASET_FORMATS = ("parquet", "arrow", "dataset")


def _published_records(path: Path) -> list[dict]:
    """The records of one published file: a JSON array, or JSON Lines."""
    if path.suffix == ".json":
        return json.loads(path.read_text())
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _math_records() -> list[dict]:
    """Every MATH fixture problem (all subjects, prealgebra included) as one table's rows."""
    return [json.loads(p.read_text()) for folder in sorted((MATH_FIXTURE / "test").iterdir())
            for p in sorted(folder.glob("*.json"), key=lambda p: (len(p.stem), p.stem))]


def _dataset_copy(records: list[dict], folder: Path, stem: str, fmt: str) -> Path:
    """``records`` as ``stem.parquet``, ``stem.arrow`` (the file save_to_disk writes) or a saved ``stem/``."""
    import datasets

    folder.mkdir(parents=True, exist_ok=True)
    table = datasets.Dataset.from_list(records)
    if fmt == "parquet":
        table.to_parquet(str(folder / f"{stem}.parquet"))
        return folder / f"{stem}.parquet"
    saved = folder / ("saved" if fmt == "arrow" else stem)
    table.save_to_disk(str(saved))
    if fmt == "dataset":
        return saved
    shutil.copy(next(saved.glob("*.arrow")), folder / f"{stem}.arrow")
    return folder / f"{stem}.arrow"


# (benchmark, published file (None: MATH's whole folder), options of both loads, options of the published load)
SAME_ITEMS = [
    ("logiqa2", "logiqa2/test.txt", {}, {"ood_files": []}),
    ("logiqa2", "logiqa2/ood_test.jsonl", {"id_files": []}, {}),
    ("reclor", "reclor/val.json", {}, {}),
    ("reclor", "reclor/test.json", {"split": "test", "hard_start": 2}, {}),
    ("math", None, {}, {}),
    ("math", None, {"levels": [1]}, {}),
    ("arb", "arb/law.json", {}, {}),
    ("arb", "arb/math_numerical.json", {}, {}),
]


@pytest.mark.parametrize("fmt", DATASET_FORMATS)
@pytest.mark.parametrize("name, published, options, published_only", SAME_ITEMS,
                         ids=[f"{case[0]}-{case[1] or 'all'}-{len(case[2])}" for case in SAME_ITEMS])
def test_a_benchmark_from_one_dataset_gives_the_published_items(tmp_path, fmt, name, published, options,
                                                                published_only):
    from iga_ds.data.benchmarks import load_benchmark

    if published is None:  # MATH: one table of every subject stands for the test/ folder
        want = load_benchmark(name, MATH_FIXTURE, **options)
        records, stem = _math_records(), "test"
    else:
        path = BENCHMARK_FIXTURES / published
        want = load_benchmark(name, path.parent, **options, **published_only)
        if name == "arb":  # the published folder holds every category; the dataset one
            want = [item for item in want if item.domain == path.stem]
        records, stem = _published_records(path), path.stem
    root = _dataset_copy(records, tmp_path / fmt, stem, fmt)
    got = load_benchmark(name, root, **options)
    assert want and got == want


BAD_ROWS = [  # (benchmark, published file (None: MATH's), what row 1 is spoilt by, the error after "SOURCE: row 1: ")
    ("logiqa2", "logiqa2/test.txt", {"answer": 7}, "field 'answer': expected an index 0-3, got 7"),
    ("reclor", "reclor/val.json", {"answers": ["a", "b"]}, "field 'answers': expected 4 options, got 2"),
    ("math", None, {"type": "Topology"}, "field 'type': expected a MATH subject"),
    ("math", None, {"solution": "no box"}, "field 'solution': expected a final \\boxed"),
    ("arb", "arb/law.json", {"finalAnswer": "Q"}, "field 'finalAnswer': 'Q' is neither an option letter"),
]


@pytest.mark.parametrize("name, published, change, error", BAD_ROWS,
                         ids=[f"{case[0]}-{next(iter(case[2]))}" for case in BAD_ROWS])
def test_a_bad_row_of_a_benchmark_dataset_is_one_line_naming_source_and_row(tmp_path, name, published, change, error):
    from iga_ds.data.benchmarks import load_benchmark

    if published is None:
        records, stem = _math_records(), "test"
    else:
        records, stem = _published_records(BENCHMARK_FIXTURES / published), Path(published).stem
    records[1].update(change)
    root = _dataset_copy(records, tmp_path, stem, "parquet")
    with pytest.raises(DataError) as info:
        load_benchmark(name, root)
    message = str(info.value)
    assert message.startswith(f"{root}: row 1: {error}") and "\n" not in message


@pytest.fixture
def hub(monkeypatch):
    """A stand-in for the hub: ``hub.tables[repo]`` is what a hub id of ``repo`` loads;
    ``hub.requests`` records (repo, revision, split) of every load."""
    import datasets

    from iga_ds.data import sources

    stand_in = SimpleNamespace(tables={}, requests=[])

    def from_hub(source):
        stand_in.requests.append((source.location, source.revision, source.split))
        if source.location not in stand_in.tables:
            raise ConnectionError("the hub is not reachable")
        return datasets.Dataset.from_list(stand_in.tables[source.location])

    monkeypatch.setattr(sources, "_from_hub", from_hub)
    return stand_in


def test_benchmark_hub_ids_read_the_split_the_options_name(hub):
    from iga_ds.data.benchmarks import load_benchmark

    hub.tables["acme/logiqa2"] = _published_records(BENCHMARK_FIXTURES / "logiqa2" / "test.txt")
    hub.tables["acme/reclor"] = _published_records(BENCHMARK_FIXTURES / "reclor" / "val.json")
    hub.tables["acme/math"] = _math_records()
    hub.tables["acme/arb"] = _published_records(BENCHMARK_FIXTURES / "arb" / "law.json")
    assert load_benchmark("logiqa2", "acme/logiqa2") == load_benchmark("logiqa2", BENCHMARK_FIXTURES / "logiqa2",
                                                                        ood_files=[])
    assert {i.split for i in load_benchmark("logiqa2", "acme/logiqa2", id_files=[])} == {"ood"}
    assert load_benchmark("reclor", "acme/reclor") == load_benchmark("reclor", BENCHMARK_FIXTURES / "reclor")
    load_benchmark("reclor", "acme/reclor@v1:validation")
    assert load_benchmark("math", "acme/math") == load_benchmark("math", MATH_FIXTURE)
    law = load_benchmark("arb", "acme/arb:law")
    assert [(i.id, i.domain, i.split) for i in law] == [("arb/law/l1", "law", "ood"), ("arb/law/l2", "law", "ood")]
    assert hub.requests == [("acme/logiqa2", None, "test"), ("acme/logiqa2", None, "ood_test"),
                            ("acme/reclor", None, "val"), ("acme/reclor", "v1", "validation"),
                            ("acme/math", None, "test"), ("acme/arb", None, "law")]
    with pytest.raises(DataError, match=r"^arb: acme/arb: a hub id names its category as the split, "
                                        r"e.g. acme/arb:law$"):
        load_benchmark("arb", "acme/arb")


def test_a_benchmark_hub_id_that_cannot_load_says_where_to_obtain_the_benchmark(hub, tmp_path, monkeypatch):
    from iga_ds.data.benchmarks import load_benchmark

    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as info:  # a missing relative folder is spelled like a hub id
        load_benchmark("reclor", "data/reclor")
    message = str(info.value)
    assert message.startswith("reclor: no usable copy at data/reclor (no such file or folder, and it could not be "
                              "loaded from the Hugging Face hub (the hub is not reachable)); expected train.json")
    assert "not bundled" in message and "whyu.me/reclor" in message and "\n" not in message


def test_which_file_or_category_a_benchmark_dataset_stands_for(tmp_path):
    import datasets

    from iga_ds.data.benchmarks import load_benchmark

    table = _dataset_copy(_published_records(BENCHMARK_FIXTURES / "logiqa2" / "test.txt"), tmp_path, "test", "parquet")
    with pytest.raises(DataError, match=r"^logiqa2: .*test.parquet is one dataset, the records of one file; "
                                        r"expected id_files to name one file, got 2"):
        load_benchmark("logiqa2", table, id_files=["test.txt", "dev.txt"])
    proofs = _dataset_copy(_published_records(BENCHMARK_FIXTURES / "arb" / "math_prooflike.json"), tmp_path,
                           "math_prooflike", "parquet")
    with pytest.raises(DataError, match=r"category math_prooflike is proof-like.*include_prooflike=true"):
        load_benchmark("arb", proofs)
    assert len(load_benchmark("arb", proofs, include_prooflike=True)) == 1
    records = _published_records(BENCHMARK_FIXTURES / "reclor" / "val.json")
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(records)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"dd: a dataset with the splits validation; name one split's folder"):
        load_benchmark("reclor", tmp_path / "dd")
    assert len(load_benchmark("reclor", tmp_path / "dd" / "validation")) == len(records)
    # a file of another kind is not a dataset: the published layout's message says what is expected
    with pytest.raises(DataError, match=r"reclor: no usable copy at .*val.json; expected train.json"):
        load_benchmark("reclor", BENCHMARK_FIXTURES / "reclor" / "val.json")
