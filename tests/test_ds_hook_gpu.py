"""On 2 GPUs (NCCL, bf16): the ZeRO-2 hook against the fp32 single-process reference.

Skipped without two CUDA devices. Writes what it reached to $IGA_DS_RESULTS/gpu_equivalence.json
when that variable is set (docs/HOOK.md records a run).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from test_ds_hook import EVEN_2x2, UNEVEN_2x2, assert_params_close, reference, run

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)

# bf16 weights and activations against an fp32 reference: about 3 significant digits per
# step; AdamW's first steps move each weight by about lr, so compare relative to lr.
BF16_ATOL = 2e-3


@needs_two_gpus
@pytest.mark.parametrize("method,layout", [("iga", UNEVEN_2x2), ("erm", EVEN_2x2), ("pcgrad", EVEN_2x2)])
def test_zero2_bf16_two_gpus_match_fp32_reference(tmp_path, method, layout):
    s = {"method": method, "params": {"tau": 0.5} if method == "iga" else {}, "gas": 2, "layout": layout,
         "steps": 3, "cuda": True, "bf16": True, "lr": 1e-2, "overlap_comm": True}
    got = run(tmp_path, s)
    ref = reference({**s, "cuda": False})
    worst = max((got["params"][k] - ref[k]).abs().max().item() for k in ref)
    scale = max(ref[k].abs().max().item() for k in ref)
    record = {"method": method, "card": torch.cuda.get_device_name(0), "world_size": 2, "dtype": "bf16",
              "steps": 3, "lr": s["lr"], "max_abs_param_diff": worst, "max_abs_param": scale,
              "torch": torch.__version__}
    print(json.dumps(record))
    out = os.environ.get("IGA_DS_RESULTS")
    if out:
        with open(os.path.join(out, f"gpu_equivalence_{method}.json"), "w") as f:
            json.dump(record, f, indent=2)
    assert_params_close(got["params"], ref, atol=BF16_ATOL)
