"""iga-ds: Invariant Gradient Alignment for LoRA fine-tuning on logical isomer groups.

Not to be confused with DomainBed's unrelated "IGA" (Inter-environmental Gradient Alignment,
Koyama and Yamaguchi, 2020).

The facade: ``from iga_ds import iga_update, get_method, available_methods``. Those names are
imported on first use, so that ``import iga_ds`` (and the command line's start-up) loads no torch.
"""
from __future__ import annotations

__version__ = "0.1.0"


def __getattr__(name):
    if name == "iga_update":
        from iga_ds.methods.iga.reference import iga_update

        return iga_update
    if name in ("get_method", "available_methods"):
        import iga_ds.methods as m

        return getattr(m, name)
    raise AttributeError(name)


__all__ = ["iga_update", "get_method", "available_methods", "__version__"]
