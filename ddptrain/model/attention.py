"""Which attention kernel fits the batching: the advice logged at start (``warn_about_attention_cost``) and whether
packed rows carry flash-attention's varlen lengths (``wants_varlen_lengths``)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ddptrain.config import Attention, ModelConfig

log = logging.getLogger(__name__)


def attention_cost_warning(attn: Attention, device: torch.device, row_lengths: list[list[int]]) -> str | None:
    """Advice when the attention kernel does not fit the batching, or None when it does.

    Args:
        attn: ``model.attn_implementation``.
        device: this rank's device (only CUDA has a better choice to offer).
        row_lengths: the sample lengths in each row this rank trains on this epoch (``row_lengths`` of the
            sampler): several per row when packed.
    """
    if device.type != "cuda" or not row_lengths:
        return None
    packed = any(len(row) > 1 for row in row_lengths)
    if attn == Attention.flash_attention_2 and not packed:
        return (
            "model.attn_implementation=flash_attention_2 with padded batches: transformers unpads and re-pads every "
            "batch in every layer (index gathers and a host sync per layer). data.batching=packed hands flash-"
            "attention's varlen kernel the samples without padding."
        )
    if attn == Attention.sdpa and packed:
        extra = dense_attention_overhead(row_lengths)
        return (
            f"model.attn_implementation=sdpa with data.batching=packed builds a dense block-diagonal mask and computes "
            f"every cross-sample block: {extra:.1f}x the attention scores the samples need, on this epoch's rows "
            "(not counted in mfu). model.attn_implementation=flash_attention_2 (pip install flash-attn) computes "
            "each sample alone."
        )
    return None


def warn_about_attention_cost(
    attn: Attention, device: torch.device, row_lengths: Callable[[], list[list[int]]]
) -> None:
    """Log ``attention_cost_warning``'s advice once, from rank 0 (every rank's plan tells the same story).
    ``row_lengths`` walks the epoch's plan: only called where there is a choice to advise on (CUDA)."""
    if device.type != "cuda":
        return
    advice = attention_cost_warning(attn, device, row_lengths())
    if advice:
        log.warning(advice, extra={"same_on_all_ranks": True})  # observe.console.RANK_ZERO_ONLY: other ranks stay quiet


def dense_attention_overhead(row_lengths: list[list[int]]) -> float:
    """Attention scores a dense kernel computes over packed rows, per score the samples need: sum over rows of
    (row length)^2 over the sum of (sample length)^2 (causal masking halves both)."""
    dense = sum(sum(row) ** 2 for row in row_lengths)
    needed = sum(length**2 for row in row_lengths for length in row)
    return dense / max(needed, 1)


def wants_varlen_lengths(cfg: ModelConfig) -> bool:
    """Whether packed rows should carry their sample lengths: flash-attention's varlen kernel takes them
    (``model.attn_implementation=flash_attention_2``); other kernels find samples from the position ids."""
    return cfg.attn_implementation == Attention.flash_attention_2
