"""Run a test module's function under Triton's interpreter (``TRITON_INTERPRET=1``, the CPU),
in a fresh process: the variable is read when Triton is imported."""
from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys

import pytest


def run_interpreted(module: str, function: str, *args: str, timeout: int = 300) -> None:
    """``module.function(*args)`` (string arguments) in a child process under the interpreter;
    skips without Triton, fails with the child's error."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    here = os.path.dirname(os.path.abspath(__file__))
    # the test module sits in its package's folder (tests/methods/, ...), the helpers it imports here
    [path] = glob.glob(os.path.join(here, "**", f"{module}.py"), recursive=True)
    call = f"import {module}; {module}.{function}({', '.join(repr(a) for a in args)})"
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, (here, os.environ.get("PYTHONPATH")))))
    proc = subprocess.run([sys.executable, "-c", call], cwd=os.path.dirname(path), env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
