"""One ZeRO-2 engine of a tiny PEFT model (world size 1, gloo, CPU) as a module-scoped fixture:
the DeepSpeed seam's tests (tests/engine/) and IGA's through-the-hook tests (tests/methods/) both
use it, from different folders, so it lives here by name."""
from __future__ import annotations

import datetime
import os

import pytest
import torch

from dist_helpers import free_port
from ds_worker import ds_config, make_optimizer
from iga_ds.engine import internals
from tiny_models import tiny_peft_llama


@pytest.fixture(scope="module")
def engine():
    """One ZeRO-2 engine for the module, in this process's own one-rank process group."""
    import deepspeed

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    internals.disable_cpu_shm_comm_op()
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=120))
    model = tiny_peft_llama(seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    scenario = {"layout": [[[0, 1, 2]]], "gas": 1}
    built, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(params, scenario),
                                     config=ds_config(scenario, 1))
    yield built
    torch.distributed.destroy_process_group()
    internals.forget_world_group()
