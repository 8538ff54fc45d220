"""Engine hook (work in progress: loss-level methods only so far)."""
from __future__ import annotations

import contextlib

import torch

from iga_ds.ds.config import IGAConfig


class IGAEngineHook:
    def __init__(self, engine, config: IGAConfig):
        self.engine = engine
        self.config = config
        self.method = config.build_method()
        self._stats: dict = {}
        self.skipped_last_step = False
        if self.method.needs_domain_gradients:
            raise NotImplementedError("gradient-level methods are not wired yet")

    @contextlib.contextmanager
    def micro_batch(self, domain_ids: torch.Tensor):
        yield self

    def dummy_scale(self):
        if self.method.needs_dummy_scale():
            return torch.ones((), requires_grad=True, device=self.engine.device)
        return None

    def objective(self, sequence_losses, domain_ids, dummy_scale=None):
        return self.method.objective(sequence_losses, domain_ids, self.config.num_domains, dummy_scale)

    def pop_stats(self) -> dict:
        stats, self._stats = self._stats, {}
        return stats

    def detach(self) -> None:
        pass


def attach(engine, config: IGAConfig) -> IGAEngineHook:
    return IGAEngineHook(engine, config)
