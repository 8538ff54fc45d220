"""Where IGA's variance comes from: the step's own (the paper), or one of two departures from it.

With K groups a step, the per-element variance V of the per-domain means carries sampling
noise of order sigma^2 / K: at small K the mask sees mostly noise. ``variance`` picks V:

- ``batch`` (the paper): V of this step's per-domain means;
- ``ema`` (a departure): V of the domains' means averaged over steps (an exponential moving
  average of the per-domain factor gradients, decay ``variance_decay``, Adam-style bias
  correction), reconstructed at the current A, B, as Fishr and AND-mask accumulate over steps;
- ``debiased`` (a departure): V minus the within-domain noise that two halves of each
  domain's groups estimate, so that domains sharing one signal give V about 0 in expectation.

Either way the masked quantity and the ERM part of the projection are this step's mean, so that
tau = 0 stays ERM exactly.
"""
from __future__ import annotations

import torch

# the options' names and check sit with the others in common (options.py reads them without this module)
from iga_ds.methods.iga.common import DEFAULT_VARIANCE, DEFAULT_VARIANCE_DECAY, VARIANCES, check_variance_options  # noqa: F401
from iga_ds.methods.iga.reference import mean_and_variance, reconstruct

def split_halves(gA: torch.Tensor, gB: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """2N x ... per-(domain, half) means, domain n's halves at n and N + n -> (hA1, hA2, hB1, hB2)."""
    if gA.shape[0] % 2 or gB.shape[0] != gA.shape[0]:
        raise ValueError(f"variance 'debiased' needs 2N per-(domain, half) gradients, got gA {tuple(gA.shape)} "
                         f"and gB {tuple(gB.shape)}")
    N = gA.shape[0] // 2
    return gA[:N], gA[N:], gB[:N], gB[N:]


def debiased_variance(A, B, hA1, hA2, hB1, hB2, scaling: float):
    """(mean, V_debiased) over domains of the reconstructed half means' averages.

    Domain n's mean is (h1 + h2) / 2; (h1 - h2)^2 / 4, reconstructed, estimates the noise
    variance of that mean (equal halves). The population variance V over N domains has
    expectation (spread of the signals) + (N - 1) / N * mean_n noise[n]; the second term is
    subtracted, and the result clamped at zero.
    """
    N = hA1.shape[0]
    mean, var = mean_and_variance(A, B, (hA1 + hA2) / 2, (hB1 + hB2) / 2, scaling)
    noise = torch.zeros_like(var)
    for n in range(N):
        diff = reconstruct(A, B, hA1[n] - hA2[n], hB1[n] - hB2[n], scaling)
        noise.addcmul_(diff, diff)
    # mean over domains of diff^2 / 4, times (N - 1) / N
    noise.mul_((N - 1) / (4.0 * N * N))
    return mean, (var - noise).clamp_min_(0)


class MovingAverages:
    """Per module (by :attr:`ModuleGrads.index`), the moving averages of the per-domain factor
    gradients and how many steps they hold; a checkpoint takes them as flat tensors."""

    def __init__(self, decay: float):
        self.decay = decay
        self.modules: dict[int, dict[str, torch.Tensor]] = {}

    def update(self, index: int, gA: torch.Tensor, gB: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add this step's per-domain means; return the bias-corrected averages (N x ... each).

        A step whose gradients are not finite (the hook skips it) leaves the averages as they
        were, without a wait for the device."""
        state = self.modules.get(index)
        if state is None:
            state = {"gA": torch.zeros_like(gA), "gB": torch.zeros_like(gB),
                     "steps": torch.zeros((), dtype=torch.int64, device=gA.device)}
        state = {k: v.to(gA.device) for k, v in state.items()}
        finite = torch.isfinite(gA.sum() + gB.sum())
        beta = self.decay
        for key, g in (("gA", gA), ("gB", gB)):
            moved = state[key] * beta + g.to(state[key].dtype) * (1 - beta)
            state[key] = torch.where(finite, moved, state[key])
        state["steps"] = state["steps"] + finite.to(torch.int64)
        self.modules[index] = state
        # 1 - beta^t; t >= 1 once a finite step came (before one, the averages are zeros anyway)
        correction = 1 - beta ** state["steps"].clamp_min(1).to(torch.float64)
        inverse = (1 / correction).to(state["gA"].dtype)
        return state["gA"] * inverse, state["gB"] * inverse

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{index}.ema_{key}": t for index, state in sorted(self.modules.items()) for key, t in state.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        modules: dict[int, dict[str, torch.Tensor]] = {}
        for name, tensor in state.items():
            index, _, key = name.partition(".ema_")
            if not index.isdigit() or key not in ("gA", "gB", "steps"):
                raise ValueError(f"method state: unexpected key {name!r} (expected '<module index>.ema_gA', "
                                 "'.ema_gB' or '.ema_steps')")
            modules.setdefault(int(index), {})[key] = tensor
        self.modules = modules
