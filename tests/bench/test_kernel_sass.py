"""tools/kernel_sass.py: the tile kernel's machine code counted without a GPU."""
from __future__ import annotations

import importlib.util
import json

import pytest

import kernel_sass  # tools/ is on the path: pytest's pythonpath option (pyproject.toml)

SASS = """Function:k
--:-:-:-:1\tMOV R1, c[0x0][0x28];
LBB0:
--:-:-:-:1\tHGMMA.64x64x16.F32.BF16 R24, gdesc[UR4].tnspB, RZ, !UPT;
--:-:-:-:2\tWARPGROUP.DEPBAR.LE gsb0, 0x0;
--:-:-:-:1\tFMUL R2, R3, R4;
--:-:-:-:1\t@P4 FMUL R2, R2, 0.25;
--:-:5:-:1\tMUFU.RCP R2, R2;
--:-:-:-:6\t@P0 BRA LBB0;
--:-:-:-:1\tEXIT;
LBB1:
--:-:-:Y:0\tBRA LBB1;
"""


def test_the_loop_is_the_longest_and_predicated_instructions_count():
    ops = kernel_sass.loop_instructions(SASS)
    assert ops == {"HGMMA.64": 1, "WARPGROUP.DEPBAR": 1, "FMUL": 2, "MUFU.RCP": 1, "BRA": 1}
    row = kernel_sass.per_element(ops, elements=2)
    assert row["fp32_pipe"] == 1.0 and row["mufu"] == 0.5 and row["total"] == 3.0
    assert row["mma_per_tile"] == 1 and row["mma_waits_per_tile"] == 1
    with pytest.raises(ValueError, match="no loop"):
        kernel_sass.loop_instructions("Function:k\n--:-:-:-:1\tEXIT;\n")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.parametrize("normalize", ["snr", "mean"])
def test_the_approximate_division_takes_instructions_off_each_element(tmp_path, normalize):
    out = tmp_path / "sass.json"
    assert kernel_sass.main(["--normalize", normalize, "--json", str(out)]) == 0
    rows = {r["division"]: r for r in json.loads(out.read_text())["rows"]}
    exact, fast = rows["exact"], rows["approximate"]
    # the strip's loop: the mean's and N - 1 = 3 deviations' products, two steps of 16 of 2r = 32
    assert exact["mma_per_tile"] == fast["mma_per_tile"] == 8
    if normalize == "snr":
        # the exact division's range checks and scalings, gone; the reciprocal stays, with exp2
        assert exact["fp32_pipe"] - fast["fp32_pipe"] >= 4
        assert exact["mufu"] == fast["mufu"] == 2
    else:  # "mean" divides nothing: one code
        assert exact["total"] == fast["total"] and fast["mufu"] == 1


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_the_kernels_keep_fused_multiply_adds_whatever_triton_defaults_to(monkeypatch):
    # Triton 3.10 turns fused multiply-adds off unless asked for (this variable sets that
    # default): the kernels ask, so the tile kernel's loop keeps its multiply-adds
    from triton.tools.disasm import get_sass

    from iga_ds.methods.iga import triton_kernels

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    ops = kernel_sass.loop_instructions(get_sass(triton_kernels.compile_tile_kernel().asm["cubin"]))
    assert ops["FFMA"] >= 4 * 32  # per tile: the deviations' squares, the mask's exponent, the squared norm


def test_every_kernel_launch_asks_for_the_same_compiler_options():
    import ast
    import pathlib

    from iga_ds.methods.iga import triton_kernels

    launches = []
    for path in pathlib.Path(triton_kernels.__file__).parent.glob("*.py"):  # every Triton module of the method
        tree = ast.parse(path.read_text())
        launches += [(path.name, node) for node in ast.walk(tree)
                     if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                     and isinstance(node.func.value, ast.Name) and node.func.value.id.endswith("_kernel")]
    assert len(launches) >= 8  # triton_kernels' seven and the Jacobi kernel
    for name, call in launches:
        # **LAUNCH_OPTIONS, or **triton_kernels.LAUNCH_OPTIONS from another module
        splats = [getattr(k.value, "id", getattr(k.value, "attr", None)) for k in call.keywords if k.arg is None]
        where = f"{name}, line {call.lineno}"
        assert "LAUNCH_OPTIONS" in splats, f"{call.func.value.id} launched without LAUNCH_OPTIONS ({where})"
