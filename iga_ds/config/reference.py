"""docs/CONFIG.md, generated from the config's fields and the registered methods.

    python -m iga_ds.config.reference docs/CONFIG.md      # rewrite it
    python -m iga_ds.config.reference --check docs/CONFIG.md   # exit 1 when it is stale

Every key's documentation lives on its field; this module only lays the fields out.
"""
from __future__ import annotations

import argparse
import json
import sys
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from iga_ds.config.base import type_phrase
from iga_ds.config.hook import HookConfig
from iga_ds.config.run import RunConfig, TinyBaseConfig
from iga_ds.files import atomic_write_text
from iga_ds.methods import available_methods, method_class, method_parameters

HEADER = """# Configuration reference

Generated from the fields of `iga_ds.config` by `python -m iga_ds.config.reference docs/CONFIG.md`;
the test suite fails when this file and the code disagree. Two files configure a run:

- the **run YAML** (`iga-ds train --config RUN.yaml`, `launch/train.py --config RUN.yaml`), whose
  keys can also be set on the command line as `KEY=VALUE` (`schedule.max_steps=100`);
- the **DeepSpeed JSON** (`deepspeed:` in the run YAML, or `--deepspeed`), DeepSpeed's own config
  plus an `iga` block for the engine hook (JSON or hjson). Its batch sizes, `gradient_clipping`,
  `bf16`/`fp16.enabled` and any AdamW optimizer and warm-up scheduler values are `"auto"` or
  agree with the run YAML (`zero_optimization.reduce_bucket_size: "auto"` becomes the model's
  hidden size squared, as the Hugging Face Trainer sets it), which counts batches in isomer groups and owns the optimizer and its
  schedule; a key iga-ds cannot honour is an error naming it, and so is a key the installed
  DeepSpeed does not know (at the top level or in a section such as `zero_optimization` or
  `bf16`), with the nearest known key: DeepSpeed itself would ignore a misspelt section.

The method (`method.name`, `method.params`) and the domains (`data.domains`) can be set in either
file: in the JSON's `iga` block they are `method`, `params` and `domains`. Set each in one of
them: a value given in both that differs is an error naming both files. Every key is typed; a
wrong key, type or value stops the run before anything starts, naming the file, the dotted key
and what was expected; a wrong key given on the command line names that `KEY=VALUE`. A method
parameter is checked against the method's own parameters before the two files are compared.
"""


def _default(info) -> str:
    if info.default_factory is not None:
        value = info.default_factory()
    elif info.default is PydanticUndefined:
        return "(required)"
    else:
        value = info.default
    return "" if isinstance(value, BaseModel) else f"`{json.dumps(value)}`"


def _kind(info) -> str:
    """What the key takes: the field's rule in words when it has one, else its type."""
    return (info.json_schema_extra or {}).get("expected") or type_phrase(info.annotation)


def _is_section(tp: Any) -> bool:
    while typing.get_origin(tp) is typing.Union or type(tp).__name__ == "UnionType":
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _section_of(tp: Any) -> type[BaseModel]:
    while not (isinstance(tp, type) and issubclass(tp, BaseModel)):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def _rows(model: type[BaseModel], prefix: str = "") -> list[str]:
    rows, nested = [], []
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        doc = (info.description or "").replace("|", "\\|")
        if _is_section(info.annotation):
            nested.append((key, info))
            if info.default is None:  # an optional section: its absence means something
                rows.append(f"| `{key}` | a mapping or null | `null` | {doc} |")
            continue
        rows.append(f"| `{key}` | {_kind(info)} | {_default(info)} | {doc} |")
    for key, info in nested:
        rows += _rows(_section_of(info.annotation), f"{key}.")
    return rows


def _table(model: type[BaseModel], prefix: str = "") -> str:
    return "\n".join(["| key | type | default | meaning |", "|---|---|---|---|"] + _rows(model, prefix))


def _method_rows() -> list[str]:
    rows = ["| method | scope | parameters (default) | statistics it logs | reference |", "|---|---|---|---|---|"]
    for name in available_methods():
        cls = method_class(name)
        # what the method accepts (the registry's check reads the same) and reports, no more
        params = [f"`{p.name}={json.dumps(p.default)}`" for p in method_parameters(name).values() if p.name != "seed"]
        stats = ", ".join(f"`{s.name}`" if s.combine == "model" else f"`{s.name}` ({s.combine})"
                          for s in cls.statistics) or "-"
        rows.append(f"| `{name}` | {cls.scope} | {', '.join(params) or '-'} | {stats} | {cls.paper} |")
    return rows


def _statistic_rows() -> list[str]:
    seen, rows = set(), ["| statistic | whole-model figure | meaning |", "|---|---|---|"]
    for name in available_methods():
        for stat in method_class(name).statistics:
            if stat.name not in seen:
                seen.add(stat.name)
                key, how = (f"hook.method/{stat.name}", f"the whole model's (`{name}`)") if stat.combine == "model" \
                    else (f"hook.{stat.name}", f"{stat.combine} over modules")
                rows.append(f"| `{key}` | {how} | {stat.doc} |")
    return rows


def render() -> str:
    parts = [
        HEADER,
        "## The run YAML",
        "",
        _table(RunConfig),
        "",
        "### `model.tiny`: the built-in base",
        "",
        "With `model.name_or_path: builtin:tiny` only. Each setting is a base of its own in the cache "
        "(`$IGA_DS_CACHE/tiny-base/<hash>`, default `$XDG_CACHE_HOME/iga-ds`, else `~/.cache/iga-ds`).",
        "",
        _table(TinyBaseConfig, "model.tiny."),
        "",
        "## The DeepSpeed JSON's `iga` block",
        "",
        _table(HookConfig, "iga."),
        "",
        "## Methods",
        "",
        "`method.name` (or `iga.method`) and the keyword arguments `method.params` (or `iga.params`) "
        "takes. `module` methods combine each LoRA module's per-domain gradients on its own (spread over "
        "the ranks), `global` ones need every module at once, `loss` ones change the objective and "
        "capture nothing. `seed` comes from `iga.seed`.",
        "",
        *_method_rows(),
        "",
        "Whole-model statistics in `metrics.jsonl` (`hook.<name>`), each combined from the modules' as "
        "shown (`mean`: weighted by each module's out x in elements):",
        "",
        *_statistic_rows(),
        "",
    ]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write (or check) docs/CONFIG.md from the config's fields.")
    parser.add_argument("path", help="the Markdown file, e.g. docs/CONFIG.md")
    parser.add_argument("--check", action="store_true", help="exit 1 when the file differs from the code")
    args = parser.parse_args(argv)
    text = render()
    path = Path(args.path)
    if args.check:
        current = path.read_text(encoding="utf-8") if path.is_file() else ""
        if current != text:
            print(f"{path} is stale: run python -m iga_ds.config.reference {path}", file=sys.stderr)
            return 1
        return 0
    atomic_write_text(path, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
