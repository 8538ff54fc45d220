"""The default built-in base: the tiny LLaMA pretrained on text of the procedural generator.

``iga-ds pretrain-tiny`` and ``model.name_or_path: builtin:tiny`` both land here. The corpus
is shortcut-free generator output (its own seed, apart from the demo's data seeds), rendered
with the same prompt and target format as fine-tuning. Its cue sentences are neutral (the
slot word is independent of the answer): the base reads the cue words without learning the
shortcut, so that a shortcut planted in fine-tuning data is visible to the model and not an
unknown token. The tokenizer's vocabulary is the corpus's words plus every word the
generator can emit. See ``iga_ds.train.model`` for the model and the cache.

A base's cache key hashes its corpus, and generating the corpus to hash it takes a tenth of a
second or more. So beside the base folders, ``tiny-base/<recipe>.recipe.json`` records the key
the corpus of a recipe gives: a recipe is everything the corpus and the key come from apart from
the corpus itself (its size and seed, the source of the modules that write it, the Python
version, and the key's other inputs: the settings, the tokenizer version, the libraries, the
device). A lookup of a recorded recipe reads that file and generates nothing; a record is
written once a recipe's key is known (a base built or found by its corpus, as a folder of an
older version without one is, once).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Sequence

from iga_ds.config.run import TinyBaseConfig
from iga_ds.data.domains import DOMAINS
from iga_ds.data.patterns import BOOLEAN_ANSWERS
from iga_ds.data.prompts import format_prompt, format_target
from iga_ds.data.synth import generate_groups
from iga_ds.errors import ConfigError, UserError
from iga_ds.files import atomic_write_json, read_json
from iga_ds.models import cache_root
from iga_ds.train.batching import format_example
from iga_ds.train.model import BASE_FILES, ensure_tiny_base, pretrain_device, tiny_base_key

PRETRAIN_GROUPS = TinyBaseConfig().corpus_groups
PRETRAIN_SEED = 9_001  # far from the seeds the demo and the example configs use
TINY_FOLDER = "tiny-base"  # under the cache root, as ensure_tiny_base writes it
RECIPE_SUFFIX = ".recipe.json"
# imported here but writes none of the corpus; its part of the key is tiny_base_key's other inputs
_NOT_CORPUS_CODE = ("iga_ds.train.model",)
_KEY = re.compile(r"[0-9a-f]{16}")


def corpus_texts(records: Sequence[dict]) -> list[str]:
    out = []
    for rec in records:
        prompt, target = format_example(rec)
        out.append(prompt + target)
    return out


def generator_corpus(groups: int = PRETRAIN_GROUPS, seed: int = PRETRAIN_SEED) -> list[str]:
    """Texts of ``groups`` freshly generated, shortcut-free isomer groups: the training split's,
    then the test split's (the order ``iga-ds data synth`` writes them in)."""
    if groups < 1:
        raise ConfigError(f"the pretraining corpus needs at least one group, got {groups}")
    records = generate_groups(groups, seed, shortcut=0.0, neutral_cue=True)
    ordered = [r for split in ("train", "test") for r in records if r["meta"]["split"] == split]
    return corpus_texts(ordered)


def generator_words() -> list[str]:
    """Every word the procedural generator can write in any domain (sorted), so that the base's
    vocabulary covers data generated with other seeds, patterns or cues than its corpus."""
    words: set[str] = set()

    def visit(value) -> None:
        if isinstance(value, str):
            words.update(re.findall(r"[A-Za-z]+", re.sub(r"\{[^}]*\}", " ", value)))
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, (tuple, list)):
            for v in value:
                visit(v)

    visit(BOOLEAN_ANSWERS)
    visit(format_prompt({"problem": ""}) + format_target({"cot": "", "answer": ""}))
    for domain in DOMAINS.values():
        for f in dataclasses.fields(domain):
            visit(getattr(domain, f.name))
        for status in ("proven", "refuted", "unknown"):  # closing lines are written in code
            visit(domain.conclusion("class", status, z="", b=""))
            visit(domain.conclusion("prop", status, s="", q=""))
    return sorted(words)


# -- the recipe, and its record ------------------------------------------------------------


# ``from iga_ds.x import a, b`` (in parentheses over lines, too) and ``import iga_ds.x``; a
# regular expression, as parsing the files would take as long as generating the corpus
_IMPORT = re.compile(r"^\s*(?:from\s+(iga_ds[\w.]*)\s+import\s+(\([^)]*\)|[^\n]*)|import\s+(iga_ds[\w.]*))", re.M)


def _module_imports(path: Path) -> set[str]:
    """The iga_ds modules a source file imports, at the top or in a function (a name taken
    from a module may be a submodule: both are listed, and what has no file is skipped)."""
    found: set[str] = set()
    for module, names, plain in _IMPORT.findall(path.read_text(encoding="utf-8")):
        if plain:
            found.add(plain)
        else:
            found.add(module)
            found.update(f"{module}.{n.split()[0]}" for n in re.sub(r"#[^\n]*", "", names).strip("()").split(",")
                         if n.strip())
    return found


def corpus_code_files() -> dict[str, Path]:
    """The source file of this module and of every iga_ds module it imports, transitively, but
    for :data:`_NOT_CORPUS_CODE`: the code the corpus and the extra words come from."""
    package = Path(__file__).resolve().parents[1]
    files: dict[str, Path] = {}
    todo = [__name__]
    while todo:
        name = todo.pop()
        if name in files or name in _NOT_CORPUS_CODE:
            continue
        base = package.joinpath(*name.split(".")[1:])
        path = next((p for p in (base.with_name(base.name + ".py"), base / "__init__.py") if p.is_file()), None)
        if path is not None:
            files[name] = path
            todo.extend(_module_imports(path))
    return dict(sorted(files.items()))


@functools.lru_cache(maxsize=1)
def corpus_code_digest() -> str | None:
    """A hash of :func:`corpus_code_files`; None where this module runs without its source
    (then nothing is recorded and every lookup generates the corpus)."""
    if Path(__file__).suffix != ".py":
        return None
    h = hashlib.sha256()
    for name, path in corpus_code_files().items():
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def corpus_recipe(config: TinyBaseConfig, groups: int, seed: int, device: str) -> dict | None:
    """What the key of the base pretrained on ``generator_corpus(groups, seed)`` comes from,
    the corpus aside; None without the source to hash."""
    code = corpus_code_digest()
    if code is None:
        return None
    return {"groups": groups, "seed": seed, "code": code, "python": "%d.%d" % sys.version_info[:2],
            # the key of an empty corpus: every other input of the key (settings, versions, device)
            "settings": tiny_base_key(config, (), (), device)}


def recipe_path(folder: Path, recipe: dict) -> Path:
    """The record of ``recipe`` in a ``tiny-base`` folder."""
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    return folder / f"{digest}{RECIPE_SUFFIX}"


def recorded_key(folder: Path, recipe: dict | None) -> str | None:
    """The key recorded for ``recipe`` in ``folder``; None without a record (or a readable one)."""
    if recipe is None or not recipe_path(folder, recipe).is_file():
        return None
    try:
        record = read_json(recipe_path(folder, recipe), objects=True, error=UserError)
    except UserError:
        return None  # damaged: found again by the corpus, and written anew
    key = record.get("key")
    return key if record.get("recipe") == recipe and isinstance(key, str) and _KEY.fullmatch(key) else None


def record_key(folder: Path, recipe: dict | None, key: str) -> None:
    """Record ``key`` for ``recipe`` in ``folder``; where that fails (a read-only cache), lookups
    generate the corpus as before."""
    if recipe is not None and recorded_key(folder, recipe) != key:
        try:
            atomic_write_json(recipe_path(folder, recipe), {"key": key, "recipe": recipe})
        except OSError:
            pass


def builtin_key(config: TinyBaseConfig, device: str, folder: Path, groups: int | None = None,
                seed: int = PRETRAIN_SEED) -> str:
    """The cache key of the base ``default_tiny_base`` pretrains in ``config`` on ``device``: the
    one recorded in the ``tiny-base`` folder ``folder``, else computed from the corpus (and recorded)."""
    groups = config.corpus_groups if groups is None else groups
    recipe = corpus_recipe(config, groups, seed, device)
    key = recorded_key(folder, recipe)
    if key is None:
        key = tiny_base_key(config, generator_corpus(groups, seed), generator_words(), device)
        record_key(folder, recipe, key)
    return key


def default_tiny_base(
    config: TinyBaseConfig | None = None,
    groups: int | None = None,
    seed: int = PRETRAIN_SEED,
    cache_dir: str | None = None,
    progress: bool = True,
    log=print,
) -> Path:
    """Folder of the cached tiny base, pretraining it first on a cache miss. ``groups``: the
    corpus size, default ``config.corpus_groups``. A recorded recipe generates no corpus."""
    config = config or TinyBaseConfig()
    groups = config.corpus_groups if groups is None else groups
    device = pretrain_device()
    folder = (Path(cache_dir) if cache_dir else cache_root()) / TINY_FOLDER
    recipe = corpus_recipe(config, groups, seed, device)
    key = recorded_key(folder, recipe)
    if key is not None and all((folder / key / name).is_file() for name in BASE_FILES):
        log(f"tiny base: cached at {folder / key}")  # as ensure_tiny_base says it
        return folder / key
    texts = generator_corpus(groups, seed)
    base = ensure_tiny_base(texts, config, cache_dir, progress=progress, log=log, extra_words=generator_words(),
                            device=device)
    record_key(base.parent, recipe, base.name)
    return base
