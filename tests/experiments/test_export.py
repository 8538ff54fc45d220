"""`iga-ds export` and the portable adapter training leaves: a merged model that reproduces the
adapter's logits, an adapter whose base is named portably (loaded from elsewhere), the model
card, and one-line errors. One short training run on a shrunk built-in base serves every test."""
from __future__ import annotations

import json
import os
import stat
import shutil
from pathlib import Path

import pytest
from test_train_support import DOMAINS, run_config_dict, write_isomer_jsonl
from tiny_models import SHRUNK_TINY_BASE

from iga_ds.cli import main

TINY = {**SHRUNK_TINY_BASE, "corpus_groups": 10}  # seconds to pretrain


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run on ``builtin:tiny`` (shrunk, in the fixture's own cache), 3 steps of IGA, a checkpoint
    at step 2: (root, run folder, base folder, cache folder)."""
    from iga_ds.config.run import config_from_dict
    from iga_ds.train.trainer import Trainer

    root = tmp_path_factory.mktemp("export")
    os.environ["IGA_DS_CACHE"] = str(root / "cache")  # the suite's own; put back after the first test
    data = write_isomer_jsonl(root / "train.jsonl", groups=4, seed=5)
    cfg = config_from_dict(run_config_dict(root, data, output_dir=str(root / "run"), **{
        "model.tiny": TINY, "schedule.max_steps": 3, "checkpoint.every_steps": 2,
        "method.name": "iga", "method.params": {"tau": 0.5}}))
    result = Trainer(cfg, quiet=True).run()
    assert result.status == "completed"
    import yaml

    base = yaml.safe_load((root / "run" / "config.resolved.yaml").read_text())["resolved"]["base_model_dir"]
    return root, root / "run", Path(base), root / "cache"


def machine_paths(folder: Path, *roots: Path) -> list[str]:
    """Files of ``folder`` whose text names one of ``roots`` or the home folder (a machine path)."""
    needles = [str(r) for r in roots] + [str(Path.home())]
    return [f"{p.name}: {n}" for p in folder.rglob("*") if p.is_file() and p.suffix in (".json", ".md", ".yaml",
                                                                                             ".jinja", ".txt")
            for n in needles if n in p.read_text(encoding="utf-8", errors="replace")]


def logits_of(model, ids):
    import torch

    with torch.no_grad():
        return model.eval()(input_ids=ids).logits.float()


def token_ids(tokenizer):
    import torch

    text = "the apple is 3 . the pear is the apple plus 4 . what is the pear ?"
    return torch.tensor([tokenizer(text)["input_ids"]])


def adapter_model(base: Path, adapter: Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(adapter))


# -- the reference and the card, without a model ---------------------------------------------


def test_names_stay_names_and_the_front_matter_names_the_hub_base(tmp_path):
    from iga_ds.train.model_card import CardFacts, model_card, portable_base, resolve_reference

    for name in ("org/model@main", "packaged:smollm2-135m-instruct", "builtin:tiny"):
        assert portable_base(name, tmp_path) == name and resolve_reference(name, tmp_path) == name
    (tmp_path / "org" / "model").mkdir(parents=True)  # "./": no hub id reads the same
    assert portable_base(str(tmp_path / "org" / "model"), tmp_path / "org") == "./model"
    assert resolve_reference("./model", tmp_path / "org") == str(tmp_path / "org" / "model")
    card = model_card(CardFacts(base="packaged:smollm2-135m-instruct", method="erm", steps=5), merged=True)
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct\nbase_model_relation: merge\n" in card
    assert "base_model: org/model\nbase_model_relation: adapter\nlibrary_name: peft\n" in model_card(
        CardFacts(base="org/model@main"))
    assert "base_model:" not in model_card(CardFacts(base="../models/base"))


# -- what training leaves ---------------------------------------------------------------------


def test_the_trained_adapters_name_their_base_portably_and_carry_a_card(run):
    root, folder, base, cache = run
    for adapter in [folder / "adapter", *sorted((folder / "checkpoints").glob("step_*/adapter"))]:
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == "builtin:tiny"
        assert json.loads((adapter / "tiny_base.json").read_text()) == {"tiny": TINY}
        assert not machine_paths(adapter, root, base, cache)
        card = (adapter / "README.md").read_text()
        assert card.startswith("---\nlibrary_name: peft\n") and "- iga\n" in card
        assert "| method | iga (tau=0.5) |" in card and "| learning rate | 0.005 |" in card
        assert f"domains {', '.join(DOMAINS)}, {4 * len(DOMAINS)} records, 4 isomer groups" in card
    final = (folder / "adapter" / "README.md").read_text()
    assert "| steps | 3 |" in final and "(step 3)" in final
    assert "| steps | 2 of 3 |" in (folder / "checkpoints" / "step_00000002" / "adapter" / "README.md").read_text()


def test_the_adapters_own_reference_resolves_through_the_built_in_base(run, monkeypatch):
    """The diagnostic's reader of an adapter on its own (copied out of its run) finds the same
    built-in base, in the shape the adapter records, from any working directory."""
    from iga_ds.experiments import diagnose as dg

    root, folder, base, cache = run
    monkeypatch.setenv("IGA_DS_CACHE", str(cache))
    alone = root / "alone" / "adapter"
    if not alone.exists():
        shutil.copytree(folder / "adapter", alone)
    monkeypatch.chdir(root / "alone")
    source = dg.resolve_source(str(alone))
    assert source.kind == "adapter" and source.base == "builtin:tiny" and source.tiny == TINY
    model, _, _ = dg.load_model(source, dg.FreshLora(), device="cpu", progress=False)
    assert Path(source.base) == base  # a cache hit: the base the run trained on


# -- merge ------------------------------------------------------------------------------------


def test_the_merged_model_reproduces_the_adapter_logits(run, tmp_path, capsys):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, folder, base, cache = run
    out = tmp_path / "merged"
    assert main(["export", str(folder), "--out", str(out)]) == 0
    assert "wrote the merged model (float32)" in capsys.readouterr().out
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.bin"))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the temporary folder is gone
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    ids = token_ids(tokenizer)
    merged = AutoModelForCausalLM.from_pretrained(str(out))
    want = logits_of(adapter_model(base, folder / "adapter"), ids)
    torch.testing.assert_close(logits_of(merged, ids), want, rtol=1e-5, atol=1e-5)
    plain = logits_of(AutoModelForCausalLM.from_pretrained(str(base)), ids)
    assert not torch.allclose(plain, want)
    card = (out / "README.md").read_text()
    assert "library_name: transformers" in card and "| steps | 3 |" in card and "`builtin:tiny`" in card
    assert not machine_paths(out, root, base, cache)
    assert _modes(out) == {p.name: _new_file_mode() for p in out.iterdir()}  # weights not left 0600
    half = tmp_path / "bf16"
    assert main(["export", str(folder / "adapter"), "--out", str(half), "--dtype", "bfloat16", "--quiet"]) == 0
    merged16 = AutoModelForCausalLM.from_pretrained(str(half))
    assert next(merged16.parameters()).dtype == torch.bfloat16
    # held to the adapter's own effect on the logits (bf16 rounding costs a few percent of it): a
    # fixed tolerance near that effect passed a merge of half the adapter
    effect = (want - plain).abs().max().item()
    error = (logits_of(merged16, ids) - want).abs().max().item()
    assert error < 0.15 * effect, f"the bf16 merge is off by {error:.4f} where the adapter moves the logits by " \
                                  f"{effect:.4f}"


# -- adapter only -----------------------------------------------------------------------------


def test_adapter_only_from_the_run_keeps_the_built_in_name_and_the_runs_card(run, tmp_path, monkeypatch):
    root, folder, base, cache = run
    out = tmp_path / "shared"
    assert main(["export", str(folder / "checkpoints" / "step_00000002"), "--adapter-only", "--out", str(out)]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "builtin:tiny" and (out / "adapter_model.safetensors").is_file()
    card = (out / "README.md").read_text()
    assert "| steps | 2 of 3 |" in card and "| method | iga (tau=0.5) |" in card and "(step 2)" in card
    assert not machine_paths(out, root, base, cache)
    assert _modes(out) == {p.name: _new_file_mode() for p in out.iterdir()}
    # from another working directory, through the name: the same base, the adapter loads on it
    monkeypatch.setenv("IGA_DS_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    from iga_ds.train.model_card import base_location, read_tiny

    assert Path(base_location(config["base_model_name_or_path"], read_tiny(out))) == base


def test_adapter_only_names_a_local_base_relative_to_the_output_and_loads_after_a_move(run, tmp_path, monkeypatch):
    """An adapter on its own over a local base folder (PEFT's absolute path, as older runs saved
    it): exported beside the base, both moved elsewhere, loaded with PEFT from a third folder."""
    import torch
    from transformers import AutoTokenizer

    from iga_ds.experiments import diagnose as dg

    root, folder, base, cache = run
    shutil.copytree(base, tmp_path / "site" / "models" / "base")
    old = tmp_path / "old_adapter"
    shutil.copytree(folder / "adapter", old, ignore=lambda _, names: ["tiny_base.json", "README.md"])
    config = json.loads((old / "adapter_config.json").read_text())
    (old / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(
        tmp_path / "site" / "models" / "base")}))
    assert main(["export", str(old), "--adapter-only", "--out", str(tmp_path / "site" / "share" / "adapter")]) == 0
    shutil.move(str(tmp_path / "site"), str(tmp_path / "moved"))
    exported = tmp_path / "moved" / "share" / "adapter"
    ref = json.loads((exported / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert ref == "../../models/base"
    assert "relative to this folder" in (exported / "README.md").read_text()
    monkeypatch.chdir(tmp_path)
    ids = token_ids(AutoTokenizer.from_pretrained(str(exported)))
    got = logits_of(adapter_model(exported / ref, exported), ids)
    torch.testing.assert_close(got, logits_of(adapter_model(base, folder / "adapter"), ids), rtol=0, atol=0)
    assert Path(dg.resolve_source(str(exported)).base) == tmp_path / "moved" / "models" / "base"


def test_an_adapter_naming_the_built_in_bases_cache_folder_is_exported_as_builtin_tiny(run, tmp_path):
    """An adapter saved with the cache folder of the built-in base as its base (as the demo and
    older runs saved theirs) is exported naming ``builtin:tiny`` and the shape, which rebuild
    that same folder; the same folder pretrained on other text is named by its path."""
    from iga_ds.train.model_card import builtin_shape

    root, folder, base, cache = run
    old = tmp_path / "old_adapter"
    shutil.copytree(folder / "adapter", old, ignore=lambda _, names: ["tiny_base.json", "README.md"])
    config = json.loads((old / "adapter_config.json").read_text())
    (old / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(base)}))
    assert main(["export", str(old), "--adapter-only", "--out", str(tmp_path / "out"), "--quiet"]) == 0
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "builtin:tiny"
    assert json.loads((tmp_path / "out" / "tiny_base.json").read_text()) == {"tiny": TINY}
    other = tmp_path / "tiny-base" / "0123456789abcdef"
    shutil.copytree(base, other)
    assert builtin_shape(str(other)) is None


# -- the documented commands ------------------------------------------------------------------


def test_the_commands_of_docs_export_md_run_on_a_run(run, tmp_path, monkeypatch, capsys):
    """docs/EXPORT.md's command lines, run as written in a folder whose runs/my_run is the
    fixture's run (its checkpoint renamed to the step the page shows)."""
    import re
    import shlex

    root, folder, base, cache = run
    text = (Path(__file__).resolve().parents[2] / "docs" / "EXPORT.md").read_text(encoding="utf-8")
    lines = [re.sub(r"\s+#\s.*$", "", line) for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)
             for line in block.splitlines() if line.startswith("iga-ds export ")]
    assert len(lines) == 3
    shutil.copytree(folder, tmp_path / "runs" / "my_run")
    os.rename(tmp_path / "runs" / "my_run" / "checkpoints" / "step_00000002",
              tmp_path / "runs" / "my_run" / "checkpoints" / "step_00000200")
    (tmp_path / "runs" / "my_run" / "eval").mkdir()  # an evaluation under the run, as a grid's cell has
    (tmp_path / "runs" / "my_run" / "eval" / "synthetic.json").write_text(json.dumps(
        {"benchmark": "synthetic", "accuracy": 50.0, "id_accuracy": 62.5, "ood_accuracy": 37.5, "n_scored": 16}))
    monkeypatch.chdir(tmp_path)
    for line in lines:
        assert main(shlex.split(line)[1:]) == 0, line
        out = Path(shlex.split(line)[shlex.split(line).index("--out") + 1])
        assert (out / "README.md").is_file() and (out / "config.json").is_file() != ("--adapter-only" in line)
    assert "wrote the adapter" in capsys.readouterr().out
    assert "| synthetic | 50.0 | 62.5 | 37.5 | 16 |" in (tmp_path / "runs" / "my_run-merged" / "README.md").read_text()
    assert "## Evaluation" not in (tmp_path / "runs" / "my_run-step200" / "README.md").read_text()  # not the end's


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize("case, says", [
    ("missing", "no such folder"),
    ("no_adapter", "no adapter_config.json"),
    ("unfinished_run", "a run folder without adapter/"),
    ("out_taken", "exists and is not empty; give --overwrite"),
])
def test_bad_input_is_one_line_and_exit_2(run, tmp_path, capsys, case, says):
    root, folder, base, cache = run
    source, out = tmp_path / "source", tmp_path / "out"
    if case == "no_adapter":
        source.mkdir()
        (source / "notes.txt").write_text("no adapter here")
    elif case == "unfinished_run":
        source.mkdir()
        shutil.copy(folder / "config.resolved.yaml", source)
    elif case == "out_taken":
        source = folder
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    rc = main(["export", str(source), "--out", str(out), "--adapter-only"])
    err = capsys.readouterr().err
    assert rc == 2 and says in err, err
    assert err.startswith("iga-ds: error:") and len(err.strip().splitlines()) == 1
    assert (str(out) if case == "out_taken" else str(source)) in err
    assert not out.exists() or [p.name for p in out.iterdir()] == ["keep.txt"]
    if case == "out_taken":  # asked for: replaced whole
        assert main(["export", str(folder), "--out", str(out), "--adapter-only", "--overwrite", "--quiet"]) == 0
        assert (out / "adapter_config.json").is_file() and not (out / "keep.txt").exists()


def test_export_eval_and_diagnose_name_a_run_its_checkpoints_and_adapters_alike(run, tmp_path):
    """One lookup (config.run.locate_adapter) behind the three commands that take a trained adapter."""
    from iga_ds.config.run import locate_adapter
    from iga_ds.evaluation.bases import run_adapter
    from iga_ds.experiments.diagnose import resolve_source
    from iga_ds.experiments.export import find_adapter

    root, folder, base, cache = run
    checkpoint = folder / "checkpoints" / "step_00000002"
    cases = {folder: folder / "adapter", folder / "adapter": folder / "adapter", checkpoint: checkpoint / "adapter",
             checkpoint / "adapter": checkpoint / "adapter"}
    for given, adapter in cases.items():
        assert locate_adapter(given, "x") == (adapter, folder), given
        assert run_adapter(str(given)) == (adapter, folder)
        assert find_adapter(str(given)).adapter == adapter and find_adapter(str(given)).run == folder
        source = resolve_source(str(given))
        assert (source.adapter, source.kind) == (adapter, "run"), given
    assert find_adapter(str(checkpoint)).step == 2 and find_adapter(str(folder)).step is None
    assert locate_adapter(tmp_path, "x") is None


def _modes(folder):
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}


def _new_file_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask
