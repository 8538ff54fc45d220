"""Run a test module's function under Triton's interpreter (``TRITON_INTERPRET=1``, the CPU),
in a fresh process: the variable is read when Triton is imported."""
from __future__ import annotations

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
    call = f"import {module}; {module}.{function}({', '.join(repr(a) for a in args)})"
    proc = subprocess.run([sys.executable, "-c", call], cwd=here, env=dict(os.environ, TRITON_INTERPRET="1"),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
