"""The ``"iga"`` block of a DeepSpeed JSON config: which method, its parameters, the domains.

Example block (every field optional but ``method``)::

    "iga": {
      "method": "iga",                  // a name from iga_ds.methods.available_methods()
      "params": {"tau": 0.5, "normalize": "snr"},    // keyword arguments of that method
      "domains": ["math", "medical", "legal", "science"],
      "seed": 0,                        // seeds the per-module random sketches
      "skip_nonfinite": true,           // skip the step on NaN/Inf instead of corrupting weights
      "timeout_s": 600,                 // collectives give up after this many seconds
      "owner_balance": "out_x_in",      // how modules are assigned to owner ranks
      "overlap_waves": 1                // >1: modules in this many waves, one wave's collectives
                                        // running while another's method does (docs/PERFORMANCE.md)
    }
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from iga_ds.errors import ConfigError

DEFAULT_DOMAINS = ("math", "medical", "legal", "science")

# field -> (expected type(s), human description); the one place that documents the block.
_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "method": ((str,), "a method name"),
    "params": ((dict,), "an object of method parameters"),
    "domains": ((list,), "a list of domain names"),
    "seed": ((int,), "an integer"),
    "skip_nonfinite": ((bool,), "true or false"),
    "timeout_s": ((int, float), "a number of seconds"),
    "owner_balance": ((str,), '"out_x_in" or "round_robin"'),
    "overlap_waves": ((int,), "a whole number of waves, at least 1"),
}


@dataclass
class IGAConfig:
    method: str = "erm"
    params: dict[str, Any] = field(default_factory=dict)
    domains: list[str] = field(default_factory=lambda: list(DEFAULT_DOMAINS))
    seed: int = 0
    skip_nonfinite: bool = True
    timeout_s: float = 600.0
    owner_balance: str = "out_x_in"
    overlap_waves: int = 1

    @property
    def num_domains(self) -> int:
        return len(self.domains)

    @classmethod
    def from_dict(cls, block: dict[str, Any], where: str = "iga") -> "IGAConfig":
        if not isinstance(block, dict):
            raise ConfigError(f"{where}: expected an object, got {type(block).__name__}")
        for key, value in block.items():
            if key not in _FIELDS:
                raise ConfigError(
                    f"{where}.{key}: unknown key; expected one of: {', '.join(sorted(_FIELDS))}"
                )
            types, desc = _FIELDS[key]
            # bool is an int in Python; do not let `true` pass as a seed
            if isinstance(value, bool) and bool not in types:
                raise ConfigError(f"{where}.{key}: expected {desc}, got {value!r}")
            if not isinstance(value, types):
                raise ConfigError(f"{where}.{key}: expected {desc}, got {value!r}")
        cfg = cls(**copy.deepcopy(block))
        cfg.validate(where)
        return cfg

    def validate(self, where: str = "iga") -> None:
        from iga_ds.methods import get_method

        if len(self.domains) < 2 and self.method not in ("erm",):
            raise ConfigError(f"{where}.domains: method {self.method!r} needs at least 2 domains")
        if len(set(self.domains)) != len(self.domains):
            raise ConfigError(f"{where}.domains: names must be unique, got {self.domains}")
        if self.owner_balance not in ("out_x_in", "round_robin"):
            raise ConfigError(f"{where}.owner_balance: expected \"out_x_in\" or \"round_robin\", got {self.owner_balance!r}")
        if self.overlap_waves < 1:
            raise ConfigError(f"{where}.overlap_waves: expected a whole number of waves, at least 1, "
                              f"got {self.overlap_waves}")
        if self.timeout_s <= 0:
            raise ConfigError(f"{where}.timeout_s: expected a positive number, got {self.timeout_s}")
        try:
            get_method(self.method, **self.params)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}.params: {exc}") from None

    def build_method(self):
        from iga_ds.methods import get_method

        from iga_ds.methods import method_parameters

        params = dict(self.params)
        if "seed" in method_parameters(self.method) and "seed" not in params:
            params["seed"] = self.seed
        return get_method(self.method, **params)

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "params": copy.deepcopy(self.params),
            "domains": list(self.domains),
            "seed": self.seed,
            "skip_nonfinite": self.skip_nonfinite,
            "timeout_s": self.timeout_s,
            "owner_balance": self.owner_balance,
            "overlap_waves": self.overlap_waves,
        }


def split_config(ds_config: dict[str, Any]) -> tuple[dict[str, Any], IGAConfig]:
    """Separate the ``"iga"`` block from a DeepSpeed config dict (DeepSpeed rejects nothing
    it does not know, but keeping it out avoids surprises); a config without one means ERM."""
    ds = copy.deepcopy(ds_config)
    block = ds.pop("iga", None)
    cfg = IGAConfig.from_dict(block) if block is not None else IGAConfig()
    return ds, cfg
