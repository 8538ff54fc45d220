"""The only package that touches DeepSpeed internals: the ZeRO engine hook and its collectives.

Public use::

    ds_dict, iga_cfg = split_config(json.load(open("ds_configs/zero2.json")))
    engine, *_ = deepspeed.initialize(model=peft_model, model_parameters=params, config=ds_dict)
    hook = attach(engine, iga_cfg)
    for batch in micro_batches:
        with hook.micro_batch(batch.domain_ids):
            scale = hook.dummy_scale()            # None unless the method needs it (IRM)
            logits = engine(...).logits           # multiply by scale when it is not None
            loss = hook.objective(sequence_losses, batch.domain_ids, scale)
            engine.backward(loss)
        engine.step()
        stats = hook.pop_stats()                  # filled at each accumulation boundary
"""
from __future__ import annotations

from iga_ds.ds.config import IGAConfig, split_config
from iga_ds.ds.hook import IGAEngineHook, attach

__all__ = ["IGAConfig", "IGAEngineHook", "attach", "split_config"]
