"""The ZeRO engine hook: per-domain gradients captured in backward, combined by a method at the
accumulation boundary. ``internals.py`` is the one module of iga-ds that touches DeepSpeed's
internals; ``collectives.py`` runs every collective; ``layout.py`` places modules on ranks;
``hook.py`` is the flow of a step, its helpers in modules of their own (``packing.py``,
``float32_copies.py``, ``finite.py``, ``phase_clock.py``).

Public use::

    ds_dict, _ = split_config(json.load(open("ds_configs/zero2.json")))
    iga_cfg = HookConfig.from_dict({"method": "iga", "params": {"tau": 0.5}})
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

from iga_ds.config.hook import HookConfig, split_config
from iga_ds.engine.hook import EngineHook, attach

__all__ = ["HookConfig", "EngineHook", "attach", "split_config"]
