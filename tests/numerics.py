"""Tolerances that follow from the arithmetic, not from what one CPU happened to round to (tests/README.md).

Two computations of the same float32 result that add the same terms in another order (a chunked head against the
full logits, a packed row against padded ones, one kernel against another) differ by their rounding errors. A sum of
``n`` terms is off by about ``sqrt(n)`` units in the last place of its magnitude: the rounding errors of its
additions add up like a random walk (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §4.2, the
probabilistic bound). A gradient passes through ``depth`` such reductions in a row on its way from the loss, each
adding its own, and two computations are compared, so both errors count. Which way each rounds depends on the kernel
the matrix library picks for the CPU's instruction set (AVX-512 here, SSE4 there): a bound measured on one machine
fails on the next, a bound derived from ``n`` and ``depth`` holds on both.
"""

from __future__ import annotations

import math

import torch

HEADROOM = 2.0
"""The two computations compared each carry their own rounding error."""


def reordered_sum_tolerance(n_terms: int, depth: int = 1, dtype: torch.dtype = torch.float32) -> float:
    """The relative difference allowed between two results of ``depth`` chained reductions of up to ``n_terms`` terms
    each, computed in ``dtype`` in different orders: ``HEADROOM * depth * sqrt(n_terms) * eps(dtype)``.

    A defect (a token trained twice or not at all, a chunk left out, a wrong mask) moves a loss or a gradient by a
    share of one token's contribution in the batch, at least 1e-3 of it in these tests: orders of magnitude above it.
    """
    return HEADROOM * depth * math.sqrt(n_terms) * torch.finfo(dtype).eps
