"""``iga-ds diagnose``: how much of the task and of a planted shortcut each method's gradient, and
the optimizer's update of it, keeps.

On one model (a training run's adapter, or a base with a fresh LoRA adapter) and the first K
isomer groups of a data set whose records carry a cue sentence (``meta.cue``), two directions
per LoRA module, from per-domain mean gradients of the factors (gA[n], gB[n]):

- the **task** direction t: the mean over domains of the gradients on the *no-cue twins* (each
  problem with its cue sentence removed);
- the **cue** direction c: the mean gradient on the cue records minus t.

Each method's combined gradient U is its ``combine`` of the cue records' per-domain gradients
(through the registry, with the parameters given), ERM's the plain mean t + c. A method keeps
of a direction d the share ``<U, d> / <U_erm, d>`` (1: as much as ERM, 0: none), measured in the factor space
(gA and gB over all modules, one vector) and in the weight space, where a factor step is
G = s (gB A + B gA) per module (every module's G, one vector). Also cos(U, t), cos(U, c), U's
size over ERM's, and how much the per-domain directions disagree across domains:
spread = sqrt(mean_n ||d[n] - d||^2) / ||d||, for t[n] (no-cue gradients) and c[n] (cue minus
no-cue gradients of domain n). The same shares, cosines and sizes of the optimizer's update
u(U) (``after_optimizer``): one AdamW or SGD-momentum step on U, clipped as training clips it,
from the moments saved with the adapter's checkpoint, or from zero moments
(:mod:`iga_ds.experiments.preconditioning`). docs/DIAGNOSE.md says how to read them; the
measures are in :mod:`iga_ds.experiments.diagnose_measures`, the run over a run's checkpoints
in :mod:`iga_ds.experiments.diagnose_trajectory`.

The gradients come from a plain loop, one domain at a time, backward after backward on a PEFT
model (no DeepSpeed, no capture hook): the slow, obvious path, independent of the training
machinery it is there to explain.
"""
from __future__ import annotations

import filecmp
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from iga_ds.config.run import BUILTIN_TINY, RUN_CONFIG, DataConfig, LoraSettings, locate_adapter
from iga_ds.data.groups import complete_groups
from iga_ds.data.prompts import AUTO, PromptFormat, prompt_format, saved_prompt_format
from iga_ds.data.schema import read_isomer_jsonl
from iga_ds.errors import ConfigError, DataError, UserError
from iga_ds.evaluation.generation import resolve_device
from iga_ds.experiments.diagnose_measures import REFERENCE, SPACES, measure
from iga_ds.experiments.export import ADAPTER_WEIGHTS
from iga_ds.experiments.preconditioning import OptimizerState, check_covered, optimizer_updates, read_optimizer_state
from iga_ds.files import atomic_write_json, read_yaml_file
from iga_ds.lora.modules import LoraModule, find_lora_modules
from iga_ds.methods import GradientMethod, ModuleGrads, get_method
from iga_ds.models import TOKENIZER_FILES, check_model_source
from iga_ds.progress import progress as progress_of
from iga_ds.train.batching import encode_example, pad_id, pad_rows, sequence_losses
from iga_ds.train.model import add_lora, load_base_model, load_tokenizer
from iga_ds.train.checkpoint import FULL_OPTIMIZER_FILE, latest_checkpoint
from iga_ds.train.model_card import adapter_base, base_location, read_tiny

# -- methods ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class MethodSpec:
    """``NAME`` or ``NAME:KEY=VALUE,KEY=VALUE`` as given (``label``), split into a registered
    method's name and its parameters (JSON values where they parse, else strings)."""

    label: str
    name: str
    params: dict[str, Any] = field(default_factory=dict)


# a comma starts a new parameter only where KEY= follows, so a value may hold commas ("[1,2]")
_NEXT_PARAM = re.compile(r",(?=\s*[A-Za-z_][A-Za-z0-9_-]*\s*=)")


def parse_method(text: str) -> MethodSpec:
    name, colon, rest = text.strip().partition(":")
    name = name.strip()
    if not name or (colon and not rest.strip()):
        raise UserError(f"--method {text!r}: expected NAME or NAME:KEY=VALUE,KEY=VALUE (e.g. iga:tau=0.5)")
    params: dict[str, Any] = {}
    for item in _NEXT_PARAM.split(rest) if rest.strip() else []:
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key:
            raise UserError(f"--method {text}: expected KEY=VALUE, got {item.strip()!r}")
        if key in params:
            raise UserError(f"--method {text}: parameter {key!r} given twice")
        try:
            params[key] = json.loads(value.strip())
        except json.JSONDecodeError:
            params[key] = value.strip()
    return MethodSpec(text.strip(), name, params)


def build_method(spec: MethodSpec) -> GradientMethod:
    """The registered method with the spec's parameters; a method that acts on the loss (other
    than ERM, the reference) has no update map to measure."""
    try:
        method = get_method(spec.name, **spec.params)
    except ConfigError as exc:
        raise ConfigError(f"--method {spec.label}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise UserError(f"--method {spec.label}: {exc}") from None
    if method.scope == "loss" and spec.name != REFERENCE:
        raise UserError(f"--method {spec.label}: {spec.name} changes the loss, not the per-domain gradients; "
                        "the diagnostic compares gradient methods (and erm, the reference)")
    if getattr(method, "domain_halves", False):
        # it would read the N domain means as N/2 domains' two halves
        raise UserError(f"--method {spec.label}: needs each domain's groups split in two halves, which the "
                        "diagnostic does not take; measure another variance")
    return method


def build_methods(texts: Sequence[str]) -> dict[str, GradientMethod]:
    """Label -> method, ERM first (added when not given); every spec checked before any work."""
    specs = [parse_method(t) for t in texts]
    labels = [s.label for s in specs]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise UserError(f"--method {twice[0]}: given twice")
    methods = {s.label: build_method(s) for s in specs}
    if REFERENCE not in methods:
        methods = {REFERENCE: get_method(REFERENCE), **methods}
    return {REFERENCE: methods[REFERENCE], **{k: v for k, v in methods.items() if k != REFERENCE}}


# -- records ---------------------------------------------------------------------------------


def without_cue(record: dict[str, Any]) -> dict[str, Any]:
    """The no-cue twin of a record: its problem without the cue sentence ``meta.cue``."""
    where = f"group {record.get('group_id')!r}, domain {record.get('domain')!r}"
    meta = record.get("meta") if isinstance(record.get("meta"), dict) else {}
    cue = meta.get("cue")
    if not isinstance(cue, str) or not cue.strip():
        raise DataError(f"{where}: no meta.cue; the diagnostic needs records with a planted cue sentence "
                        "(e.g. from iga-ds data synth with --shortcut 0.9)")
    problem = str(record["problem"])
    at = problem.find(cue)
    if at < 0:
        raise DataError(f"{where}: its meta.cue {cue!r} is not in its problem text")
    before, after = problem[:at].rstrip(), problem[at + len(cue):].lstrip()
    return {**record, "problem": f"{before} {after}".strip(), "meta": {**meta, "cue": None}}


def twin_groups(path: str, groups: int, domains: Sequence[str] | None) -> tuple[list[list[dict]], list[str]]:
    """The first ``groups`` complete isomer groups of ``path`` (each ordered like the domains:
    ``domains``, else every domain of the data, sorted), every record checked for its cue. A run
    trained ungrouped names one pooled domain: its checkpoint is measured on the data's domains."""
    records = read_isomer_jsonl(path, missing="--data: file not found")
    have = sorted({str(r["domain"]) for r in records})
    order = list(domains) if domains and len(domains) > 1 else have
    if len(order) < 2:
        # one domain has no spread and every mask keeps all of it: a table of ERM's figures
        raise DataError(f"{path}: every record is of domain {order[0]!r}; the diagnostic compares domains, so "
                        "--data needs isomer groups of at least 2 (an ungrouped row's train.jsonl pools them: "
                        "give the grid's data/fit.jsonl)")
    missing = [d for d in order if d not in have]
    if missing:
        raise DataError(f"{path}: no {', '.join(missing)} instances (the run's domains are {', '.join(order)})")
    found = complete_groups(records, order, path)
    if len(found) < groups:
        raise UserError(f"--groups {groups}: {path} has {len(found)} complete groups over {', '.join(order)}")
    chosen = found[:groups]
    for group in chosen:
        for rec in group:
            without_cue(rec)  # every record has its cue, before any model loads
    return chosen, order


# -- the model -------------------------------------------------------------------------------


@dataclass
class Source:
    """Where the model comes from: a run folder, an adapter folder or a base (a fresh adapter)."""

    kind: str
    base: str
    adapter: Path | None = None
    tokenizer: str | None = None
    prompt_format: str = AUTO
    domains: list[str] | None = None
    max_length: int | None = None
    tiny: dict[str, Any] | None = None  # builtin:tiny's shape, where an adapter records one
    schedule: dict[str, Any] | None = None  # the run's optimizer settings (None: the defaults)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "base": self.base, "adapter": str(self.adapter) if self.adapter else None,
                "tokenizer": self.tokenizer or self.base}


def _adapter_tokenizer(adapter: Path, fallback: str | None) -> str | None:
    """The adapter folder when training saved the tokenizer there, else ``fallback``."""
    return str(adapter) if any((adapter / f).is_file() for f in TOKENIZER_FILES) else fallback


def _run_source(folder: Path, adapter: Path) -> Source:
    """The settings a run folder records, with ``adapter`` (its final one or a checkpoint's)."""
    cfg = read_yaml_file(folder / RUN_CONFIG, "run config")
    if not isinstance(cfg, dict):
        raise UserError(f"--run {folder}: {RUN_CONFIG} is not a mapping")
    resolved, data = cfg.get("resolved") or {}, cfg.get("data") or {}
    base = resolved.get("base_model_dir") or (cfg.get("model") or {}).get("name_or_path")
    if not base:
        raise UserError(f"--run {folder}: {RUN_CONFIG} names no base model")
    if base != BUILTIN_TINY and not Path(base).exists() and Path(base).is_absolute():
        base = adapter_base(adapter)  # the run came from another machine: the base its adapter names
    fmt = saved_prompt_format(adapter) or resolved.get("prompt_format") or data.get("prompt_format") or AUTO
    return Source("run", str(base), adapter, _adapter_tokenizer(adapter, cfg.get("tokenizer")), fmt,
                  (resolved.get("iga") or {}).get("domains"), data.get("max_length"), read_tiny(adapter),
                  cfg.get("schedule"))


def checkpoint_of(adapter: Path | None) -> Path | None:
    """The checkpoint folder whose optimizer state goes with ``adapter``: its own
    (RUN/checkpoints/TAG/adapter), or for a run's final adapter the latest checkpoint that holds
    the same weights; None where there is none (a fresh or a stand-alone adapter)."""
    if adapter is None:
        return None
    if (adapter.parent / FULL_OPTIMIZER_FILE).is_file():
        return adapter.parent
    latest = latest_checkpoint(adapter.parent / "checkpoints")
    if latest is None or not (latest / FULL_OPTIMIZER_FILE).is_file():
        return None
    mine, theirs = adapter / ADAPTER_WEIGHTS, latest / "adapter" / ADAPTER_WEIGHTS
    same = mine.is_file() and theirs.is_file() and filecmp.cmp(mine, theirs, shallow=False)
    return latest if same else None


def resolve_source(run: str) -> Source:
    """``--run``: a training run's folder (its final adapter), a checkpoint's folder, an adapter
    folder (a run's, or a checkpoint's, RUN/checkpoints/TAG/adapter: the run's settings then
    apply; else its base from adapter_config.json), or a base model (``builtin:tiny``, a folder,
    a hub id, a .gguf file) to which a fresh adapter is added."""
    found = locate_adapter(Path(run).expanduser(), f"--run {run}")
    if found is not None:
        path, folder = found
        if folder is not None:
            return _run_source(folder, path)
        try:
            base = adapter_base(path)  # a relative path: against the adapter's folder
        except UserError as exc:
            raise UserError(f"--run {path}: {exc}") from None
        return Source("adapter", base, path, _adapter_tokenizer(path, None), saved_prompt_format(path) or AUTO,
                      tiny=read_tiny(path))
    if run == BUILTIN_TINY:
        return Source("base", BUILTIN_TINY)  # pretrained (or read from the cache) when the model loads
    check_model_source(run, "--run")
    return Source("base", run)


@dataclass
class FreshLora:
    """The adapter added to a bare base: PEFT's (B = 0) unless ``init_b_std`` draws B."""

    r: int = LoraSettings().r
    alpha: float = LoraSettings().alpha
    target_modules: list[str] = field(default_factory=lambda: list(LoraSettings().target_modules))
    init_b_std: float = 0.0
    seed: int = 0


def load_model(source: Source, fresh: FreshLora, dtype: str = "float32", device: str = "cpu", progress: bool = True):
    """(PEFT model in eval mode on ``device``, its trainable LoRA modules, tokenizer). Eval mode:
    no dropout, so that the gradients are the same on every call."""
    if source.base == BUILTIN_TINY:
        source.base = base_location(BUILTIN_TINY, source.tiny, progress=progress)
    model = load_base_model(source.base, dtype)
    if source.adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(source.adapter), is_trainable=True)
    else:
        torch.manual_seed(fresh.seed)  # A's initialization: the same adapter for the same seed
        model = add_lora(model, fresh.r, fresh.alpha, 0.0, list(fresh.target_modules))
        if fresh.init_b_std > 0:
            gen = torch.Generator().manual_seed(fresh.seed)
            with torch.no_grad():
                for module in find_lora_modules(model):
                    w = module.lora_B.weight
                    w.copy_(torch.randn(w.shape, generator=gen, dtype=torch.float64) * fresh.init_b_std)
    model.to(device).eval()
    modules = find_lora_modules(model)
    if not modules:
        raise UserError("the model has no trainable LoRA module")
    return model, modules, load_tokenizer(source.tokenizer or source.base)


# -- per-domain gradients --------------------------------------------------------------------


def encode_domains(groups: Sequence[Sequence[dict]], tokenizer: Any, fmt: PromptFormat,
                   max_length: int) -> list[list[tuple[list[int], list[int]]]]:
    """Token rows per domain (as training writes them: prompt masked, target scored)."""
    per_domain: list[list] = [[] for _ in groups[0]]
    for group in groups:
        for n, rec in enumerate(group):
            prompt, target = fmt.example(rec)
            per_domain[n].append(encode_example(tokenizer, prompt, target, max_length, fmt.add_special_tokens))
    return per_domain


def domain_gradients(model: Any, modules: Sequence[LoraModule], rows: Sequence[Sequence[tuple]], pad: int,
                     batch_size: int = 4, on_rows: Callable[[int], None] | None = None
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per module, (gA N x r x in, gB N x out x r): domain n's gradient of the mean over its
    instances of each sequence's mean target-token loss (training's per-domain mean), by one
    backward per micro-batch of ``batch_size`` instances of one domain."""
    device = modules[0].lora_A.weight.device
    out = [(torch.zeros((len(rows), *m.lora_A.weight.shape), device=device),
            torch.zeros((len(rows), *m.lora_B.weight.shape), device=device)) for m in modules]
    weights = [w for m in modules for w in (m.lora_A.weight, m.lora_B.weight)]
    for n, domain_rows in enumerate(rows):
        for w in weights:
            w.grad = None
        for start in range(0, len(domain_rows), batch_size):
            chunk = domain_rows[start:start + batch_size]
            mb = pad_rows(chunk, [n] * len(chunk), pad).to(device)
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
            (sequence_losses(logits, mb.labels).sum() / len(domain_rows)).backward()
            if on_rows is not None:
                on_rows(len(chunk))
        for m, (gA, gB) in zip(modules, out):
            for buf, w in ((gA, m.lora_A.weight), (gB, m.lora_B.weight)):
                if w.grad is not None:
                    buf[n] = w.grad.float()
    for w in weights:
        w.grad = None
    return out


def module_grads(modules: Sequence[LoraModule],
                 grads: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[ModuleGrads]:
    return [ModuleGrads(m.name, m.index, m.lora_A.weight.detach().float(), m.lora_B.weight.detach().float(), gA, gB,
                        m.scaling, m.lora_A.weight.dtype) for m, (gA, gB) in zip(modules, grads)]


# -- the command -----------------------------------------------------------------------------


@dataclass
class Settings:
    """What ``iga-ds diagnose`` is asked for (:func:`diagnose` checks it before any model loads)."""

    run: str
    data: str
    groups: int
    methods: list[str]
    out: str
    batch_size: int = 4
    max_length: int | None = None
    dtype: str = "float32"
    device: str = "auto"
    fresh: FreshLora | None = None  # a base's fresh adapter (None: the defaults)
    progress: bool = True


@dataclass
class Loaded:
    """A model ready for the measures: the PEFT model, its LoRA modules with their parameter
    names (the keys of a checkpoint's optimizer state), the tokenizer and the prompt format."""

    model: Any
    modules: list[LoraModule]
    names: list[tuple[str, str]]
    tokenizer: Any
    fmt: PromptFormat


@dataclass
class Inputs:
    """What the measures of every model share: the methods, the groups and their no-cue twins."""

    methods: dict[str, GradientMethod]
    groups: list[list[dict]]
    twins: list[list[dict]]
    domains: list[str]
    max_length: int


def prepare(settings: Settings) -> tuple[Source, Inputs]:
    """The methods, the model's source and the groups, each checked before any model loads."""
    methods = build_methods(settings.methods)
    source = resolve_source(settings.run)
    groups, domains = twin_groups(settings.data, settings.groups, source.domains)
    twins = [[without_cue(rec) for rec in group] for group in groups]
    max_length = settings.max_length or source.max_length or DataConfig().max_length
    if settings.fresh is not None and source.adapter is not None:
        raise UserError(f"--run {settings.run} has its own adapter: --lora-r, --lora-alpha, --target-modules, "
                        "--init-b-std and --seed are for a base given a fresh one")
    return source, Inputs(methods, groups, twins, domains, max_length)


def load(source: Source, settings: Settings) -> Loaded:
    model, modules, tokenizer = load_model(source, settings.fresh or FreshLora(), settings.dtype,
                                           resolve_device(settings.device), settings.progress)
    name_of = {id(p): name for name, p in model.named_parameters()}
    names = [(name_of[id(m.lora_A.weight)], name_of[id(m.lora_B.weight)]) for m in modules]
    fmt = prompt_format(tokenizer, source.prompt_format, "prompt format", UserError)
    return Loaded(model, modules, names, tokenizer, fmt)


def _gradients(loaded: Loaded, groups, settings: Settings, max_length: int, what: str) -> list[ModuleGrads]:
    rows = encode_domains(groups, loaded.tokenizer, loaded.fmt, max_length)
    bar = progress_of(sum(len(r) for r in rows), f"gradients, {what}", "instance", enabled=settings.progress)
    try:
        grads = domain_gradients(loaded.model, loaded.modules, rows, pad_id(loaded.tokenizer), settings.batch_size,
                                 bar.update)
    finally:
        bar.close()
    return module_grads(loaded.modules, grads)


def optimizer_state(source: Source, loaded: Loaded, log: Callable[[str], None]) -> OptimizerState:
    """The state the optimizer's step starts from: the adapter's checkpoint's, else zero moments."""
    state = read_optimizer_state(checkpoint_of(source.adapter), source.schedule)
    if state.source:
        check_covered(state, loaded.names)
    elif source.adapter is not None:
        log(f"diagnose: no optimizer state saved with {source.adapter}; the optimizer's update is its first "
            "step's, from zero moments")
    return state


def measure_model(loaded: Loaded, source: Source, inputs: Inputs, settings: Settings,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    """The per-domain gradients of the cue records and of their twins on the loaded model, and
    every method's figures, of its gradient and of the optimizer's update: the result's JSON."""
    groups, domains, methods = inputs.groups, inputs.domains, inputs.methods
    log(f"diagnose: {len(loaded.modules)} LoRA modules, {len(groups)} groups x {len(domains)} domains "
        f"({', '.join(domains)}), {loaded.fmt.name} prompts")
    state = optimizer_state(source, loaded, log)
    cue = _gradients(loaded, groups, settings, inputs.max_length, "cue records")
    plain = _gradients(loaded, inputs.twins, settings, inputs.max_length, "no-cue twins")
    bar = progress_of(len(methods), "methods", "method", enabled=settings.progress)
    try:
        figures = measure(cue, plain, methods, on_method=lambda label: bar.update(1),
                          precondition=lambda pairs: optimizer_updates(state, loaded.names, pairs))
    finally:
        bar.close()
    figures["after_optimizer"]["optimizer"] = state.describe()
    return {"source": source.describe(), "prompt_format": loaded.fmt.name, "max_length": inputs.max_length,
            "data": {"path": settings.data, "groups": len(groups), "domains": domains},
            "methods": [_spec_entry(label) for label in methods],  # in order (the JSON's keys are sorted)
            "num_modules": len(loaded.modules), **figures}


def diagnose(settings: Settings, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Load, take the per-domain gradients of the cue records and of their twins, measure every
    method; write the JSON (atomically) and return it."""
    source, inputs = prepare(settings)
    result = measure_model(load(source, settings), source, inputs, settings, log)
    atomic_write_json(settings.out, result)
    return result


def _spec_entry(label: str) -> dict[str, Any]:
    spec = parse_method(label)
    return {"label": label, "method": spec.name, "params": spec.params}


def _fmt(value: float | None, width: int = 7) -> str:
    if value is None:
        return "n/a".rjust(width)
    return (f"{value:.3f}" if abs(value) < 1000 else f"{value:.2e}").rjust(width)


COLUMNS = ("task", "cue", "cos_task", "cos_cue", "size")


def _table_rows(figures: dict[str, Any], labels: Sequence[str], width: int) -> list[str]:
    """One row per method: its figures in the weight, then the factor space."""
    head = f"{'method':<{width}}  " + "  ".join(
        f"{s[0].upper()} {name}".rjust(7) for s in SPACES for name in ("task", "cue", "cos t", "cos c", "size"))
    rows = [head, "-" * len(head)]
    for label in labels:
        rows.append(f"{label:<{width}}  " + "  ".join(_fmt(figures[s]["methods"][label][k]) for s in SPACES
                                                     for k in COLUMNS))
    return rows


def format_table(result: dict[str, Any]) -> str:
    """The printed summary: the directions, then one row per method and space, for the gradients
    and for the optimizer's updates."""
    lines = []
    for space in SPACES:
        d = result[space]["directions"]
        lines.append(f"{space} space: |t| {d['task_norm']:.3e}, |c| {d['cue_norm']:.3e}, "
                     f"cos(t, c) {_fmt(d['cos_task_cue'], 0).strip()}; spread across domains: "
                     f"task {_fmt(d['task_spread'], 0).strip()}, cue {_fmt(d['cue_spread'], 0).strip()}")
    labels = [entry["label"] for entry in result["methods"]]
    width = max(len("method"), *(len(label) for label in labels))
    lines += ["", "gradient: kept of each direction, as a share of ERM's (<U, d> / <U_erm, d>); "
              "W: weight space, F: factor space", *_table_rows(result, labels, width)]
    after = result.get("after_optimizer")
    if after is not None:
        opt = after["optimizer"]
        lines += ["", f"after the optimizer ({opt['optimizer']}, step {opt['step'] + 1}, {opt['moments']} moments): "
                  "the update's shares, <u(U), d> / <u(U_erm), d>", *_table_rows(after, labels, width)]
    return "\n".join(lines)
