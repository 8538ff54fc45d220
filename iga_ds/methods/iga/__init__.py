"""Invariant Gradient Alignment, the whole method in one package.

- ``common``: the defaults and input checks both paths share, and which options act only
  under another option's value;
- ``options``: every option of the registered methods, declared once (:class:`IGAOptions`),
  and how a method that does not take one refuses it;
- ``reference``: the update of one module step by step (:func:`iga_update`), the reference;
- ``rsvd``: truncated SVD, exact, randomized and single-pass;
- ``sketch``: the Gaussian test matrices, keyed by (seed, step, module), drawn for many
  modules at once;
- ``batched``: the same update for many modules at once, without the N full-rank gradients
  (:func:`batched_iga`), ``triton_kernels``, its CUDA kernels (the tile pass, the skinny
  products, the keyed draws), and ``jacobi``, the eigendecompositions of its small Grams on
  CUDA without a wait for the device;
- ``tiles``: what the batched path is handed and hands back (the engine's stable stacks, results
  that tile a few buffers, statistics on their way to the host);
- ``method``: the registered ``iga`` (the tangent projection) and ``iga_svd`` (the paper's
  rank-r truncation), which pick the path;
- ``ablations``: the paper's Table 3 variants, each changing one step.
"""
from __future__ import annotations

from iga_ds.methods.iga.ablations import IGABinaryMask, IGALoRASpace, IGANoProjection, MeanNoMask
from iga_ds.methods.iga.batched import batched_iga
from iga_ds.methods.iga.method import IGA, IGASVD, MaskedProjectionMethod
from iga_ds.methods.iga.options import IGAOptions
from iga_ds.methods.iga.reference import chain_rule_factors, iga_update

__all__ = ["IGA", "IGASVD", "IGABinaryMask", "IGALoRASpace", "IGANoProjection", "IGAOptions", "MaskedProjectionMethod",
           "MeanNoMask", "batched_iga", "chain_rule_factors", "iga_update"]
