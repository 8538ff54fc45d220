"""The built-in base's recipe records (iga_ds.train.pretrain): a lookup of a recorded recipe
generates no corpus, the record holds the key the corpus gives (the slow reference), and the
recipe changes with whatever the corpus or the key is made of."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from iga_ds.config.run import TinyBaseConfig
from iga_ds.train import pretrain
from iga_ds.train.model import BASE_FILES, tiny_base_key

SHAPE = {"hidden_size": 16, "intermediate_size": 32, "num_layers": 1, "num_heads": 2, "max_length": 32,
         "steps": 2, "batch_size": 2, "warmup_steps": 1, "corpus_groups": 3}
QUIET = {"progress": False, "log": lambda msg: None}


def _no_generator(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the corpus was generated")

    monkeypatch.setattr(pretrain, "generate_groups", refuse)
    monkeypatch.setattr(pretrain, "generator_corpus", refuse)


def _fake_build(monkeypatch, built: list):
    """ensure_tiny_base without pretraining: the real key, a folder holding every one of BASE_FILES."""
    def build(texts, config, cache_dir, progress, log, extra_words, device):
        key = tiny_base_key(config, texts, extra_words, device)
        folder = Path(cache_dir) / "tiny-base" / key
        folder.mkdir(parents=True, exist_ok=True)
        for name in BASE_FILES:
            (folder / name).write_text("{}")
        (folder / "pretrain.json").write_text(json.dumps({"key": key, "config": config.to_dict(), "device": device}))
        built.append(key)
        return folder

    monkeypatch.setattr(pretrain, "ensure_tiny_base", build)


def test_a_base_of_the_older_scheme_is_found_by_its_corpus_then_without_it(tmp_path, monkeypatch):
    """A base folder without a record (as older versions cached it) is found by its corpus, under
    the key it had; from then on its lookup, and builtin_shape's, generate nothing."""
    from iga_ds.train.model import pretrain_device
    from iga_ds.train.model_card import builtin_shape

    built = []
    _fake_build(monkeypatch, built)
    cfg = TinyBaseConfig(**SHAPE)
    texts, words = pretrain.generator_corpus(3), pretrain.generator_words()
    old = pretrain.ensure_tiny_base(texts, cfg, tmp_path, False, None, words, pretrain_device())
    assert not list(old.parent.glob("*" + pretrain.RECIPE_SUFFIX))
    assert pretrain.default_tiny_base(cfg, cache_dir=str(tmp_path), **QUIET) == old
    (record,) = old.parent.glob("*" + pretrain.RECIPE_SUFFIX)
    # the record holds the key the corpus gives: the slow reference
    assert json.loads(record.read_text())["key"] == old.name == tiny_base_key(cfg, texts, words, pretrain_device())
    _no_generator(monkeypatch)
    said = []
    assert pretrain.default_tiny_base(cfg, cache_dir=str(tmp_path), progress=False, log=said.append) == old
    assert said == [f"tiny base: cached at {old}"] and len(built) == 2  # as ensure_tiny_base says a hit
    builtin_shape.cache_clear()
    expected = {k: v for k, v in cfg.to_dict().items() if TinyBaseConfig().to_dict()[k] != v}
    assert builtin_shape(str(old)) == expected


def test_the_recipe_changes_with_what_the_corpus_and_the_key_come_from(monkeypatch):
    _no_generator(monkeypatch)
    cfg = TinyBaseConfig(**SHAPE)

    def path(config=cfg, groups=3, seed=pretrain.PRETRAIN_SEED, device="cpu") -> str:
        return pretrain.recipe_path(Path("tiny-base"), pretrain.corpus_recipe(config, groups, seed, device)).name

    same = path()
    assert path() == same == path(TinyBaseConfig(**SHAPE))
    others = [path(TinyBaseConfig(**{**SHAPE, "corpus_groups": 4})), path(groups=4), path(seed=1),
              path(device="cuda"), path(TinyBaseConfig(**{**SHAPE, "steps": 3}))]
    assert len({same, *others}) == 6
    monkeypatch.setattr(pretrain, "corpus_code_digest", lambda: "other source")
    assert path() != same
    monkeypatch.setattr(pretrain, "corpus_code_digest", lambda: None)  # no source: no record
    assert pretrain.corpus_recipe(cfg, 3, 0, "cpu") is None


def _ast_imports(path: Path) -> set[str]:
    """The slow reference of _module_imports: the iga_ds names the parsed file imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
    return {name for name in found if name.split(".")[0] == "iga_ds"}


def test_the_hashed_source_is_what_the_corpus_is_written_by():
    package = Path(pretrain.__file__).resolve().parents[1]
    for path in sorted(package.rglob("*.py")):
        assert _ast_imports(path) <= pretrain._module_imports(path), path
    files = pretrain.corpus_code_files()
    for module in ("synth", "dag", "render", "domains", "patterns", "prompts"):
        assert f"iga_ds.data.{module}" in files
    assert {"iga_ds.train.batching", "iga_ds.train.pretrain"} <= set(files)
    assert "iga_ds.train.model" not in files  # writes no text


@pytest.mark.parametrize("damage", ["missing folder", "unreadable", "other recipe", "not a key"])
def test_a_record_that_does_not_hold_is_not_trusted(tmp_path, monkeypatch, damage):
    built = []
    _fake_build(monkeypatch, built)
    cfg = TinyBaseConfig(**SHAPE)
    first = pretrain.default_tiny_base(cfg, cache_dir=str(tmp_path), **QUIET)
    (record,) = first.parent.glob("*" + pretrain.RECIPE_SUFFIX)
    content = json.loads(record.read_text())
    if damage == "missing folder":
        for path in first.iterdir():
            path.unlink()
        first.rmdir()
    elif damage == "unreadable":
        record.write_text("{not json")
    elif damage == "other recipe":
        record.write_text(json.dumps({**content, "recipe": {**content["recipe"], "groups": 4}}))
    else:
        record.write_text(json.dumps({**content, "key": f"../{first.parent.name}/{first.name}"}))  # the same folder
    assert pretrain.default_tiny_base(cfg, cache_dir=str(tmp_path), **QUIET) == first
    assert built == [first.name] * 2  # found by the corpus again (the fake build stands for a hit)
    assert json.loads(record.read_text()) == content  # and recorded anew


def test_pretrain_tiny_records_the_recipe_it_built(tmp_path, monkeypatch, capsys):
    """`iga-ds pretrain-tiny` on the generator's corpus writes the recipe record that builtin:tiny's
    lookups read: the same base is found afterwards without generating a corpus."""
    from iga_ds.cli import main
    from iga_ds.train.model import pretrain_device

    built = []
    _fake_build(monkeypatch, built)
    assert main(["pretrain-tiny", "--groups", "3", "--steps", "20", "--cache-dir", str(tmp_path)]) == 0
    base = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert built == [base.name] and (base.parent / base.name).is_dir()
    (record,) = base.parent.glob("*" + pretrain.RECIPE_SUFFIX)
    _no_generator(monkeypatch)
    cfg = TinyBaseConfig(steps=20)
    assert pretrain.builtin_key(cfg, pretrain_device(), base.parent, groups=3) == base.name
    assert json.loads(record.read_text())["key"] == base.name
