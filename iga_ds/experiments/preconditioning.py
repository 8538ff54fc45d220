"""What the optimizer makes of a method's gradient: one step from a checkpoint's own moments.

A training step clips the method's combined gradient U to the run's global norm
(``schedule.gradient_clipping``: U x c / (|U| + 1e-6) when that is under 1, as DeepSpeed does)
and hands it to the optimizer. The update u(U) is that step's change of the LoRA factors with
the learning rate factored out and no weight decay (it acts on the weights, not the gradient):

- AdamW: m' = b1 m + (1 - b1) g, v' = b2 v + (1 - b2) g^2 from the saved m, v after k steps,
  u = m_hat / (sqrt(v_hat) + eps), m_hat = m' / (1 - b1^(k+1)), v_hat = v' / (1 - b2^(k+1));
- SGD with momentum: u = buf' = mu buf + g.

The moments come from the checkpoint's ``optimizer_full.safetensors`` (every LoRA parameter's
state at full size, keyed ``NAME/exp_avg``, ``NAME/exp_avg_sq`` or ``NAME/momentum_buffer``,
the step in its metadata); a model without one (a fresh adapter) starts from zero moments: the
first step. Everything here is float64, element by element: the slow, obvious computation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from iga_ds.config.run import ScheduleConfig
from iga_ds.engine.internals import ADAM_MOMENTS, SGD_MOMENTS
from iga_ds.errors import UserError
from iga_ds.train.checkpoint import FULL_OPTIMIZER_FILE

STEP_KEY = "adam_step"  # the file's metadata: optimizer steps taken (SGD's too, despite the name)
CLIP_EPS = 1e-6  # DeepSpeed's and torch's: the norm clipping divides by |g| + 1e-6
RULES = {"adamw": ADAM_MOMENTS, "sgd": SGD_MOMENTS}


@dataclass
class OptimizerState:
    """One optimizer step's rule, its settings and the saved state of each LoRA parameter (by
    the PEFT model's parameter name; none: zero moments)."""

    kind: str
    step: int = 0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    momentum: float = 0.9
    clip: float = 1.0
    moments: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    source: str | None = None

    def describe(self) -> dict[str, Any]:
        own = {"betas": list(self.betas), "eps": self.eps} if self.kind == "adamw" else {"momentum": self.momentum}
        return {"optimizer": self.kind, "step": self.step, "gradient_clipping": self.clip, **own,
                "state": self.source, "moments": "saved" if self.source else "zero"}


def schedule_settings(schedule: dict[str, Any] | None) -> dict[str, Any]:
    """A run config's ``schedule`` over the defaults (a fresh adapter: the defaults alone)."""
    out = ScheduleConfig().to_dict()
    out.update({k: v for k, v in (schedule or {}).items() if v is not None})
    return out


def read_optimizer_state(checkpoint: Path | None, schedule: dict[str, Any] | None) -> OptimizerState:
    """The state a step from ``checkpoint`` starts from (None, or no state file: zero moments),
    under the run's schedule; a state this cannot read is refused in one line."""
    s = schedule_settings(schedule)
    if s["optimizer"] not in RULES:
        raise UserError(f"schedule.optimizer {s['optimizer']!r}: the diagnostic knows {', '.join(RULES)}")
    state = OptimizerState(s["optimizer"], betas=tuple(float(b) for b in s["betas"]), eps=float(s["eps"]),
                           momentum=float(s["momentum"]), clip=float(s["gradient_clipping"]))
    file = checkpoint / FULL_OPTIMIZER_FILE if checkpoint is not None else None
    if file is None or not file.is_file():
        return state
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        keys, meta = list(f.keys()), f.metadata() or {}
        for key in keys:
            name, _, moment = key.rpartition("/")
            state.moments.setdefault(name, {})[moment] = f.get_tensor(key).double()
    held = sorted({k for per in state.moments.values() for k in per})
    kind = next((k for k, names in RULES.items() if held == sorted(names)), None)
    if kind is None:
        raise UserError(f"{file}: holds {', '.join(held) or 'no'} state per parameter; the diagnostic reads "
                        f"AdamW's ({', '.join(ADAM_MOMENTS)}) or SGD's ({', '.join(SGD_MOMENTS)})")
    if kind != state.kind:
        raise UserError(f"{file}: holds {kind}'s state, but the run's schedule.optimizer is {state.kind}")
    if not str(meta.get(STEP_KEY, "")).isdigit():
        raise UserError(f"{file}: no {STEP_KEY} in its metadata (the optimizer steps the moments are of)")
    state.step, state.source = int(meta[STEP_KEY]), str(file)
    return state


def clip_scale(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], clip: float) -> float:
    """The factor the run's norm clipping puts on a gradient (1 when under ``clip`` or off)."""
    norm = math.sqrt(sum(float(x.double().pow(2).sum()) for pair in pairs for x in pair))
    scale = clip / (norm + CLIP_EPS) if clip > 0 else 1.0
    return min(1.0, scale)


def adam_update(g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, betas: tuple[float, float],
                eps: float) -> torch.Tensor:
    """AdamW's step from (m, v) after ``step`` steps on gradient g, over -lr, without decay."""
    b1, b2 = betas
    g = g.double()
    m_hat = (b1 * m + (1 - b1) * g) / (1 - b1 ** (step + 1))
    v_hat = (b2 * v + (1 - b2) * g * g) / (1 - b2 ** (step + 1))
    return m_hat / (v_hat.sqrt() + eps)


def momentum_update(g: torch.Tensor, buf: torch.Tensor, momentum: float) -> torch.Tensor:
    """SGD's step with momentum (no dampening) from buffer ``buf`` on gradient g, over -lr."""
    return momentum * buf + g.double()


def _saved(state: OptimizerState, name: str, key: str, like: torch.Tensor) -> torch.Tensor:
    """The saved ``key`` of parameter ``name``, on the gradient's device (zeros: no state saved)."""
    if not state.source:
        return torch.zeros(like.shape, dtype=torch.float64, device=like.device)
    held = state.moments.get(name, {}).get(key)
    if held is None:
        raise UserError(f"{state.source}: no {key} of {name} (the optimizer state of another model?)")
    if tuple(held.shape) != tuple(like.shape):
        raise UserError(f"{state.source}: {name}/{key} is {tuple(held.shape)}, the model's parameter "
                        f"{tuple(like.shape)}")
    return held.to(like.device)


def parameter_update(state: OptimizerState, name: str, g: torch.Tensor) -> torch.Tensor:
    """u(g) of one parameter, from its saved state."""
    if state.kind == "sgd":
        return momentum_update(g, _saved(state, name, SGD_MOMENTS[0], g), state.momentum)
    m, v = (_saved(state, name, key, g) for key in ADAM_MOMENTS)
    return adam_update(g, m, v, state.step, state.betas, state.eps)


def optimizer_updates(state: OptimizerState, names: Sequence[tuple[str, str]],
                      pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]
                      ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], float]:
    """(uA, uB) per module of one method's (gA, gB), clipped as training clips them, and the
    clipping's factor; ``names``: each module's (A, B) parameter names."""
    scale = clip_scale(pairs, state.clip)
    updates = [(parameter_update(state, a, scale * gA.double()), parameter_update(state, b, scale * gB.double()))
               for (a, b), (gA, gB) in zip(names, pairs)]
    return updates, scale


def check_covered(state: OptimizerState, names: Sequence[tuple[str, str]]) -> None:
    """Every saved parameter is one of the model's LoRA factors: nothing of the state is left out."""
    ours = {n for pair in names for n in pair}
    extra = sorted(set(state.moments) - ours)
    if extra:
        raise UserError(f"{state.source}: holds state of {extra[0]}, which is not a LoRA factor of this model")
