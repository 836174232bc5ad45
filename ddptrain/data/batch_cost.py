"""What a micro-batch costs in padded tokens: the one rule the sampler and the config share.

A micro-batch is a list of rows. Every row is as long as the longest one, rounded up to
``data.pad_to_multiple_of``: its cost is ``rows × round_up(longest row)``. A packed micro-batch is a
single row of concatenated samples with nothing rounded, so it costs the sum of its samples. The
rule is chosen once per batching mode (``cost_rule``), and every caller then passes the token
lengths of the samples in one micro-batch. The collator pads with the same ``round_up``; the tests
and ``bench/samplers.py`` measure costs on their own, from tensors and plans, as an independent check.

No torch, no numpy, no ddptrain imports: ``config/data.py`` checks the budget before any worker starts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

CostRule = Callable[[Sequence[int]], int]
"""Padded tokens of one micro-batch, given the token length of each of its samples."""


def ceil_div(numerator: int, denominator: int) -> int:
    """``ceil(numerator / denominator)`` in integers (no float rounding at any size)."""
    return -(-numerator // denominator)


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value``."""
    return ceil_div(value, multiple) * multiple


def cost_rule(packed: bool, pad_to_multiple_of: int) -> CostRule:
    """The cost of a micro-batch in one batching mode (picklable, for loader workers).

    Args:
        packed: ``data.batching=packed`` (one row of concatenated samples, no padding).
        pad_to_multiple_of: ``data.pad_to_multiple_of`` (ignored when packed).

    Returns:
        A function from the samples' token lengths to the micro-batch's padded tokens.
    """
    return packed_cost if packed else partial(padded_cost, pad_to_multiple_of=pad_to_multiple_of)


def padded_cost(sample_lengths: Sequence[int], pad_to_multiple_of: int) -> int:
    """One sample per row, every row padded to the longest rounded up to ``pad_to_multiple_of``."""
    return len(sample_lengths) * round_up(int(max(sample_lengths, default=0)), pad_to_multiple_of)


def packed_cost(sample_lengths: Sequence[int]) -> int:
    """One row holding every sample back to back: nothing is padded."""
    return int(sum(sample_lengths))
