"""The ``"iga"`` block of a DeepSpeed JSON config: what the engine hook does at each step.

Example block (every field optional)::

    "iga": {
      "method": "iga",
      "params": {"tau": 0.5, "normalize": "snr"},
      "domains": ["math", "medical", "legal", "science"],
      "seed": 0,
      "skip_nonfinite": true,
      "max_skipped_steps": 3,
      "timeout_s": 600
    }

``iga-ds train`` also takes ``method`` and ``domains`` from the run YAML (``method.name``,
``method.params``, ``data.domains``); the shipped DeepSpeed configs leave them to it, and a
value set differently in both files is an error naming both (:mod:`iga_ds.config.deepspeed`).
"""
from __future__ import annotations

import copy
import difflib
import inspect
from typing import Any

from pydantic import field_validator

from iga_ds.config.base import Number, Section, config_problem, finite_params, setting, validate_section
from iga_ds.data.domains import DEFAULT_DOMAINS
from iga_ds.errors import ConfigError
from iga_ds.methods import get_method, method_class, method_parameters

BLOCK = "iga"


class HookConfig(Section):
    """The engine hook's settings: which method combines the per-domain gradients, and how."""

    describe_by_rule = True

    method: str = setting("erm", "a method name (the list, with each method's parameters, is below); `erm` (the "
                          "default) captures nothing and leaves DeepSpeed's gradient as it is",
                          expected="a method name")
    params: dict[str, Any] = setting(dict, "keyword arguments of the method, e.g. `{tau: 0.5, normalize: snr}` "
                                     "for `iga` (each method's are listed below)",
                                     expected="an object of method parameters")
    domains: list[str] = setting(lambda: list(DEFAULT_DOMAINS), "the domains, in the order the method sees them; "
                                 "each optimizer step needs every one", expected="a list of domain names")
    seed: int = setting(0, "seeds each module's random sketch with (seed, step, module index): the same result at "
                        "any world size")
    skip_nonfinite: bool = setting(True, "a NaN or Inf in the loss or the combined gradient skips the step on every "
                                   "rank (false: stop the run with an error)")
    max_skipped_steps: int = setting(3, "with `skip_nonfinite`: the run stops with an error after this many skipped "
                                     "steps in a row, naming the first non-finite quantity it saw (a diverged run "
                                     "never ends as done); 0: never stop", expected="an integer >= 0", ge=0)
    check_every_steps: int = setting(100, "the gradient DeepSpeed's optimizer steps with is read back, from where its "
                                     "step reads it, at the first step the hook writes and every this many after; "
                                     "a difference from what the method wrote stops the run naming the DeepSpeed "
                                     "release (0: the first step only)", expected="an integer >= 0", ge=0)
    timeout_s: Number = setting(600.0, "the hook's collectives fail after this many seconds, so that a dead rank "
                                "stops the others; also the trainer's peer timeout: a rank whose heartbeat is "
                                "silent this long is named as lost and the others exit",
                                expected="a positive number of seconds", gt=0)

    @field_validator("params")
    @classmethod
    def _finite_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        return finite_params(params)

    @field_validator("domains")
    @classmethod
    def _unique_domains(cls, domains: list[str]) -> list[str]:
        if len(set(domains)) != len(domains):
            raise config_problem(f"names must be unique, got {domains}")
        return domains

    @property
    def num_domains(self) -> int:
        return len(self.domains)

    @classmethod
    def from_dict(cls, block: Any, where: str = BLOCK) -> "HookConfig":
        cfg = validate_section(cls, copy.deepcopy(block), where)
        cfg.validate(where)
        return cfg

    def validate(self, where: str = BLOCK) -> None:
        """Checks across fields: the method exists, takes these parameters, has enough domains."""
        if len(self.domains) < 2 and self.method != "erm":
            raise ConfigError(f"{where}.domains: method {self.method!r} needs at least 2 domains")
        try:
            get_method(self.method, **self.params)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}.params: {exc}") from None

    def build_method(self):
        params = dict(self.params)
        if "seed" in method_parameters(self.method) and "seed" not in params:
            params["seed"] = self.seed
        return get_method(self.method, **params)


def check_method_params(method: str, params: dict[str, Any], where: str) -> None:
    """Each of ``params`` is a parameter of ``method``'s signature: a misspelt one is an error
    naming it, ``where`` it is and the nearest parameter. An unknown method is left for
    :meth:`HookConfig.validate` to name."""
    try:
        accepted = method_parameters(method)
    except ConfigError:
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return
    names = [name for name, p in accepted.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    explain = getattr(method_class(method), "refusal", None)
    for key in params:
        if key not in names:
            # an option of the method's family it does not take: the family says why (and which method does)
            why = explain(key, params[key]) if explain is not None else None
            if why is not None:
                raise ConfigError(f"{where}.{key}: {why}")
            near = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ConfigError(f"{where}.{key}: method {method!r} has no parameter {key!r}; {hint}"
                              f"it takes: {', '.join(names) or '(none)'}")


def split_config(ds_config: dict[str, Any]) -> tuple[dict[str, Any], HookConfig]:
    """Separate the ``"iga"`` block from a DeepSpeed config dict (DeepSpeed ignores keys it does
    not know, but keeping it out avoids surprises); a config without one means ERM."""
    ds = copy.deepcopy(ds_config)
    block = ds.pop(BLOCK, None)
    return ds, (HookConfig.from_dict(block) if block is not None else HookConfig())

