"""An adapter that travels: its base named portably, and a model card in place of PEFT's template.

PEFT writes into ``adapter_config.json`` the base's ``name_or_path`` as loaded, for a local
folder an absolute path on this machine, and a README.md template with nothing filled in. Here
the base is named as the user wrote it (:func:`portable_base`):

- a Hugging Face hub id, a ``packaged:NAME`` and ``builtin:tiny`` as they are (the built-in
  base's shape, ``model.tiny``, in :data:`TINY_FILE` beside ``adapter_config.json`` when it is
  not the default one);
- a local folder or .gguf file as a path relative to the folder that names it (``./base`` or
  ``../models/base``), which a reader resolves against that folder (:func:`adapter_base`).

The model card (:func:`model_card`) says the base, the method and its parameters, the LoRA
settings, the data, the steps, the learning rate and the run's metrics (the last loss; the
evaluations found under the run), as plain Markdown with a front matter the Hugging Face hub
reads. It names no path of this machine. The trainer writes both into every adapter it saves;
``iga-ds export`` writes them into what it exports.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from iga_ds.config.run import ADAPTER_CONFIG, BUILTIN_TINY, RUN_CONFIG, TinyBaseConfig
from iga_ds.errors import UserError
from iga_ds.files import atomic_write_json, atomic_write_text, iter_jsonl, read_json, read_yaml_file
from iga_ds.metrics.accuracy import format_percent
from iga_ds.models.packaged import PACKAGED, PACKAGED_PREFIX
from iga_ds.train.logbook import METRICS_FILE
from iga_ds.train.pretrain import builtin_key, default_tiny_base

CARD_FILE = "README.md"
TINY_FILE = "tiny_base.json"  # beside adapter_config.json: the built-in base's shape (model.tiny)
_HF_HOME = "https://huggingface.co/"


# -- the base, named portably ------------------------------------------------------------------


def portable_base(spec: str, folder: str | os.PathLike) -> str:
    """How ``folder`` (an adapter or exported folder, or its temporary sibling) names the base
    ``spec``: a name (hub id, ``packaged:NAME``, ``builtin:tiny``) as it is, an existing local
    path relative to ``folder`` (starting with ``./`` or ``../``, so that no hub id reads the same)."""
    text = str(spec)
    if text.startswith(("builtin:", PACKAGED_PREFIX)):
        return text
    path = Path(text).expanduser()
    if not path.exists():
        return text  # a hub id
    relative = os.path.relpath(path.resolve(), Path(folder).resolve())
    return relative if relative.startswith("..") else f"./{relative}"


def resolve_reference(ref: str, folder: str | os.PathLike) -> str:
    """The base a portable reference in ``folder`` names: a relative path resolved against
    ``folder``, an absolute path or a name as it is."""
    if ref.startswith(("./", "../")) or ref in (".", ".."):
        path = (Path(folder) / ref).resolve()
        if not path.exists():
            raise UserError(f"{Path(folder) / ADAPTER_CONFIG}: its base {ref} (relative to {folder}) does not exist")
        return str(path)
    return ref


def read_tiny(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The built-in base's shape an adapter folder records, or None (the default shape, or none)."""
    path = Path(folder) / TINY_FILE
    if not path.is_file():
        return None
    return read_json(path, objects=True, error=UserError).get("tiny") or None


def adapter_base(folder: str | os.PathLike) -> str:
    """The base an adapter folder names (``base_model_name_or_path``), a relative path resolved
    against the folder; ``UserError`` when it names none."""
    config = read_json(Path(folder) / ADAPTER_CONFIG, objects=True, error=UserError)
    ref = config.get("base_model_name_or_path")
    if not isinstance(ref, str) or not ref:
        raise UserError(f"{Path(folder) / ADAPTER_CONFIG}: names no base model (base_model_name_or_path)")
    return resolve_reference(ref, folder)


def base_location(spec: str, tiny: dict[str, Any] | None = None, progress: bool = False, log=print) -> str:
    """What loads the base ``spec``: the built-in base's cached folder (pretrained first on a miss,
    in the shape ``tiny``), else ``spec`` itself (a folder, a hub id, ``packaged:NAME``, a .gguf)."""
    if spec != BUILTIN_TINY:
        return spec
    return str(default_tiny_base(TinyBaseConfig(**tiny) if tiny else None, progress=progress, log=log))


@functools.lru_cache(maxsize=8)
def builtin_shape(folder: str) -> dict[str, Any] | None:
    """The ``model.tiny`` settings (those that differ from the defaults) when ``folder`` is the
    built-in base as ``builtin:tiny`` builds it in those settings (its cache key as recorded
    beside it, else recomputed from the generator's corpus), else None: a local folder like any other."""
    path = Path(folder)
    if not (path / "pretrain.json").is_file() or path.parent.name != "tiny-base":
        return None
    record = read_json(path / "pretrain.json", objects=True, error=UserError)
    try:
        config = TinyBaseConfig(**(record.get("config") or {}))
    except (UserError, TypeError, ValueError):
        return None
    key = builtin_key(config, str(record.get("device") or "cpu"), path.parent)
    if key != path.name or key != record.get("key"):
        return None  # pretrained on other text (iga-ds pretrain-tiny --data, a shrunk corpus)
    default = TinyBaseConfig().to_dict()
    return {k: v for k, v in config.to_dict().items() if default.get(k) != v}


def name_base(spec: str, folder: str | os.PathLike, tiny: dict[str, Any] | None = None
              ) -> tuple[str, dict[str, Any] | None]:
    """(:func:`portable_base` of ``spec`` from ``folder``, the built-in base's shape or None); a
    folder the built-in base was cached in is named ``builtin:tiny``, with its shape."""
    shape = builtin_shape(str(Path(spec).resolve())) if Path(spec).is_dir() else None
    if shape is not None:
        return BUILTIN_TINY, shape or None
    ref = portable_base(spec, folder)
    return ref, (tiny or None) if ref == BUILTIN_TINY else None


def set_base(folder: str | os.PathLike, spec: str, tiny: dict[str, Any] | None = None) -> str:
    """Name the base ``spec`` portably in ``folder``'s adapter_config.json (:func:`name_base`), the
    built-in base's shape beside it; returns the reference written."""
    folder = Path(folder)
    ref, tiny = name_base(spec, folder, tiny)
    config = read_json(folder / ADAPTER_CONFIG, objects=True, error=UserError)
    config["base_model_name_or_path"] = ref
    atomic_write_json(folder / ADAPTER_CONFIG, config)
    if ref == BUILTIN_TINY and tiny:
        atomic_write_json(folder / TINY_FILE, {"tiny": tiny})
    return ref


# -- what a run records ------------------------------------------------------------------------


@dataclass
class CardFacts:
    """What a model card says; every field may be unknown (None or empty)."""

    base: str
    tiny: dict[str, Any] | None = None
    method: str | None = None
    method_params: dict[str, Any] = field(default_factory=dict)
    lora: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    steps: int | None = None
    total_steps: int | None = None
    lr: float | None = None
    prompt_format: str | None = None
    last: dict[str, Any] = field(default_factory=dict)
    evals: list[dict[str, Any]] = field(default_factory=list)


def run_facts(run: str | os.PathLike, base: str, step: int | None = None, tiny: dict[str, Any] | None = None
              ) -> CardFacts:
    """The facts of the run in folder ``run`` (its config.resolved.yaml, metrics.jsonl and
    evaluations), at ``step`` (None: the end), about its base named ``base``."""
    run = Path(run)
    cfg = read_yaml_file(run / RUN_CONFIG, "run config")
    cfg = cfg if isinstance(cfg, dict) else {}
    resolved, data = cfg.get("resolved") or {}, cfg.get("data") or {}
    method = cfg.get("method") or {}
    lora = {k: v for k, v in (cfg.get("lora") or {}).items() if k in ("r", "alpha", "dropout", "target_modules",
                                                                       "rslora")}
    train = str(data.get("train") or "")
    facts = CardFacts(
        base=base, tiny=tiny, method=method.get("name") or (resolved.get("iga") or {}).get("method"),
        method_params=dict(method.get("params") or {}), lora=lora,
        data={"train": Path(train).name if Path(train).is_absolute() or Path(train).exists() else train,
              "domains": data.get("domains") or (resolved.get("iga") or {}).get("domains"),
              "records": resolved.get("train_records"), "groups": resolved.get("train_groups")},
        steps=step if step is not None else resolved.get("total_steps"), total_steps=resolved.get("total_steps"),
        lr=(cfg.get("schedule") or {}).get("lr"), prompt_format=resolved.get("prompt_format"))
    facts.last = last_metrics(run / METRICS_FILE, facts.steps)
    facts.evals = [] if step is not None and step != facts.total_steps else run_evals(run)
    return facts


def last_metrics(path: Path, step: int | None) -> dict[str, Any]:
    """The last line of metrics.jsonl at or before ``step``: its step and loss; {} without one."""
    last: dict[str, Any] = {}
    if not path.is_file():
        return last
    for _, row in iter_jsonl(path):
        if isinstance(row, dict) and isinstance(row.get("loss"), (int, float)) and \
                (step is None or int(row.get("step", 0)) <= step):
            last = {"step": row.get("step"), "loss": row["loss"]}
    return last


def run_evals(run: Path) -> list[dict[str, Any]]:
    """Summaries of the evaluations under a run: ``eval.json`` and ``eval/*.json``."""
    found = []
    for path in [run / "eval.json", *sorted((run / "eval").glob("*.json"))]:
        try:
            result = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
        except (OSError, ValueError):
            continue
        if isinstance(result, dict) and "accuracy" in result:
            found.append({k: result.get(k) for k in ("benchmark", "accuracy", "id_accuracy", "ood_accuracy",
                                                     "n_scored")})
    return found


# -- the card ----------------------------------------------------------------------------------


def hub_base(ref: str) -> str | None:
    """The hub id of a base, where it has one: a hub id itself, or a packaged model's source."""
    if ref.startswith(PACKAGED_PREFIX):
        model = PACKAGED.get(ref[len(PACKAGED_PREFIX):])
        return model.homepage[len(_HF_HOME):] if model and model.homepage.startswith(_HF_HOME) else None
    if ref.startswith((".", "/", "builtin:")) or ref.lower().endswith(".gguf"):
        return None
    return ref.split("@", 1)[0]


def _front_matter(facts: CardFacts, merged: bool) -> str:
    lines = ["---"]
    hub = hub_base(facts.base)
    if hub:
        lines += [f"base_model: {hub}", f"base_model_relation: {'merge' if merged else 'adapter'}"]
    lines.append(f"library_name: {'transformers' if merged else 'peft'}")
    if merged:
        lines.append("pipeline_tag: text-generation")
    tags = ["iga-ds", "lora", *([facts.method] if facts.method else [])]
    lines += ["tags:", *[f"- {t}" for t in tags], "---"]
    return "\n".join(lines)


def _base_words(facts: CardFacts) -> str:
    ref = facts.base
    if ref == BUILTIN_TINY:
        return f"`{ref}`, the built-in tiny LLaMA of iga-ds" + (
            f" in the shape `{json.dumps(facts.tiny, sort_keys=True)}` (`model.tiny`)" if facts.tiny else "")
    if ref.startswith(PACKAGED_PREFIX):
        return f"`{ref}` (`iga-ds model fetch {ref[len(PACKAGED_PREFIX):]}`)"
    if ref.startswith("."):
        return f"the local model at `{ref}`, relative to this folder"
    return f"`{ref}`"


def _plain(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list, bool)) or value is None else str(value)


def _rows(facts: CardFacts) -> list[tuple[str, str]]:
    params = ", ".join(f"{k}={_plain(v)}" for k, v in sorted(facts.method_params.items()))
    lora = ", ".join(f"{k} {', '.join(v) if isinstance(v, list) else _plain(v)}" for k, v in facts.lora.items())
    d = facts.data
    data = ", ".join(x for x in (
        f"`{d['train']}`" if d.get("train") else "",
        f"domains {', '.join(d['domains'])}" if d.get("domains") else "",
        f"{d['records']} records" if d.get("records") is not None else "",
        f"{d['groups']} isomer groups" if d.get("groups") is not None else "") if x)
    steps = None if facts.steps is None else (
        f"{facts.steps} of {facts.total_steps}" if facts.total_steps not in (None, facts.steps) else str(facts.steps))
    last = facts.last
    return [(k, v) for k, v in (
        ("base model", _base_words(facts)),
        ("method", f"{facts.method}" + (f" ({params})" if params else "") if facts.method else None),
        ("LoRA", lora or None), ("data", data or None), ("steps", steps),
        ("learning rate", None if facts.lr is None else f"{facts.lr:g}"),
        ("prompt format", facts.prompt_format),
        ("last loss", f"{last['loss']:.4f} (step {last['step']})" if last else None)) if v]


def _percent(value: Any) -> str:
    """An accuracy of eval.json, which holds percentages already (iga_ds.metrics.accuracy)."""
    return format_percent(value, "", "") if isinstance(value, (int, float)) and not isinstance(value, bool) else ""


def _evals(facts: CardFacts) -> list[str]:
    if not facts.evals:
        return []
    lines = ["", "## Evaluation", "", "| set | accuracy % | ID % | OOD % | items |", "|---|---|---|---|---|"]
    lines += [f"| {e.get('benchmark') or ''} | {_percent(e.get('accuracy'))} | {_percent(e.get('id_accuracy'))} | "
              f"{_percent(e.get('ood_accuracy'))} | {e.get('n_scored') or ''} |" for e in facts.evals]
    return lines


def model_card(facts: CardFacts, merged: bool = False) -> str:
    """The README.md of an adapter folder (``merged``: of a merged model folder)."""
    what = "A model merged from a LoRA adapter" if merged else "A LoRA adapter"
    lines = [_front_matter(facts, merged), "", f"# {what} trained with iga-ds", "",
             f"{what} fine-tuned with iga-ds (Invariant Gradient Alignment for LoRA on logical isomer groups).",
             "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in _rows(facts)]
    lines += _evals(facts)
    if merged:
        lines += ["", "Load it with `AutoModelForCausalLM.from_pretrained(FOLDER)`; no adapter is needed."]
    else:
        lines += ["", "Load it with `PeftModel.from_pretrained(base, FOLDER)` on the base above, or give the folder "
                  "to `iga-ds eval --adapter` or `iga-ds export`."]
    return "\n".join(lines) + "\n"


def write_card(folder: str | os.PathLike, facts: CardFacts, merged: bool = False) -> None:
    atomic_write_text(Path(folder) / CARD_FILE, model_card(facts, merged))


def make_portable(folder: str | os.PathLike, run: str | os.PathLike, spec: str, tiny: dict[str, Any] | None = None,
                  step: int | None = None) -> str:
    """In a freshly saved adapter folder of the run in ``run``: its base ``spec`` named portably and
    the model card in place of PEFT's; returns the reference written."""
    ref = set_base(folder, spec, tiny)
    write_card(folder, run_facts(run, ref, step, read_tiny(folder)))
    return ref

