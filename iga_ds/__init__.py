"""iga-ds: Invariant Gradient Alignment for LoRA fine-tuning on logical isomer groups.

Not to be confused with DomainBed's unrelated "IGA" (Inter-environmental Gradient Alignment,
Koyama and Yamaguchi, 2020).
"""
from __future__ import annotations

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: `import iga_ds` stays cheap for the CLI; torch loads on first use.
    if name == "iga_update":
        from iga_ds.methods.iga import iga_update

        return iga_update
    if name in ("get_method", "available_methods"):
        import iga_ds.methods as m

        return getattr(m, name)
    raise AttributeError(name)


__all__ = ["iga_update", "get_method", "available_methods", "__version__"]
