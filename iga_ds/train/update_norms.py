"""How far each LoRA module moves, per optimizer step and over the run.

A method that shrinks or masks the update (IGA's mask, a projection, a penalty) moves the adapter
less than ERM on the same steps; a lower wrong-cue rate may then mean "learned less", not "learned
something more invariant". So every run records, per LoRA module:

- ``path``: the sum over optimizer steps of the norm of that step's change of the module's
  factors (A and B together), in parameter space;
- ``displacement``: ``||scaling * B A||_F`` at the end, the module's weight change in weight
  space (PEFT starts B at zero, so ``B A`` is the whole change from the base);

written to ``update_norms.json`` (the report's table of update size against ERM), and each
step's norm over all modules as ``update_norm`` in metrics.jsonl. The factors are read
before and after the step with multi-tensor (``_foreach``) kernels: a handful of launches per
step, no host sync beyond the one the step record already makes.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from iga_ds.files import atomic_write_json
from iga_ds.lora.modules import find_lora_modules

UPDATE_NORMS_FILE = "update_norms.json"
_PEFT_PREFIX = "base_model.model."  # PeftModel's wrapper names; the base model's own names are shorter


class UpdateNorms:
    """The LoRA factors of ``model`` (a PEFT model), tracked step by step."""

    def __init__(self, model):
        modules = find_lora_modules(model)
        adapters = {m.name.rsplit(".", 1)[1] for m in modules}
        self.names: list[str] = []
        for m in modules:  # "layers.0.self_attn.q_proj", with ".<adapter>" only when there are several
            layer, adapter = m.name.rsplit(".", 1)
            short = layer.removeprefix(_PEFT_PREFIX)
            self.names.append(short if len(adapters) == 1 else f"{short}.{adapter}")
        # (A, B, scaling) per module
        self.factors = [(m.lora_A.weight, m.lora_B.weight, m.scaling) for m in modules]
        self.params = [w for a, b, _ in self.factors for w in (a, b)]  # A0, B0, A1, B1, ...
        device = self.params[0].device if self.params else torch.device("cpu")
        self.path = torch.zeros(len(self.names), dtype=torch.float64, device=device)
        self.before: list[torch.Tensor] = []

    @torch.no_grad()
    def begin_step(self) -> None:
        if not self.before:
            self.before = [torch.empty_like(p) for p in self.params]
        if self.params:
            torch._foreach_copy_(self.before, self.params)

    @torch.no_grad()
    def end_step(self) -> torch.Tensor:
        """This step's update norm over every module (0-dim, on the device); adds each module's
        to its path."""
        if not self.params:
            return torch.zeros((), dtype=torch.float64)
        deltas = torch._foreach_sub(self.params, self.before)
        squares = torch.stack(torch._foreach_norm(deltas)).double().square().view(-1, 2).sum(1)
        self.path += squares.sqrt()
        return squares.sum().sqrt()

    @torch.no_grad()
    def displacement(self) -> list[float]:
        norms = [(scaling * (b.double() @ a.double())).norm() for a, b, scaling in self.factors]
        return torch.stack(norms).tolist() if norms else []

    def state(self) -> list[float]:
        """What a checkpoint keeps, so that a resumed run's paths continue the killed one's."""
        return self.path.tolist()

    def load_state(self, path: list[float] | None) -> None:
        if path is not None and len(path) == len(self.names):
            self.path.copy_(torch.tensor(path, dtype=torch.float64))

    def summary(self, steps: int) -> dict[str, Any]:
        paths = self.path.tolist()
        return {"steps": steps, "modules": {name: {"path": p, "displacement": d}
                                            for name, p, d in zip(self.names, paths, self.displacement())}}

    def write(self, folder: Path, steps: int) -> Path:
        path = Path(folder) / UPDATE_NORMS_FILE
        atomic_write_json(path, self.summary(steps))
        return path
