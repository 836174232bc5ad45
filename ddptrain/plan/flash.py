"""flash-attention 2 as the plan simulates it: the tensors its kernels allocate, without computing anything.

flash-attn cannot be imported without CUDA, and transformers' SDPA path, the nearest kernel that runs here, builds a
(rows x 1 x width x width) mask for padded or packed rows, which flash never does: at 8,192 packed tokens that is
64 MiB a layer kept for backward that the real step never allocates. So the fake model runs this attention function
instead (registered with transformers under ``PLANNED_FLASH``), which allocates what flash-attn's kernels allocate
(``flash_attn_interface.py`` and ``csrc/flash_attn/flash_api.cpp``, flash-attn 2.x):

- forward: the output, shaped like the query, and the log-sum-exp of each query row, fp32 per head and token; both
  kept for backward with the query, key and value (as the kernel's autograd function keeps them);
- backward: the query's, key's and value's gradients; an fp32 accumulator for the query's gradient (rows rounded up
  to 128, the head dim to 32 or 64) and the fp32 row sums of out x d_out; with fewer key/value heads than query heads
  (grouped-query attention) the key's and value's gradients at every query head first, then summed.

Nothing grows with the square of the width. Padded rows are simulated at their padded width, where the real kernel
runs on the unpadded tokens (transformers unpads them first): by the padding's share of the query, key and value an
upper bound.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

PLANNED_FLASH = "ddptrain_planned_fa2"
"""The name the fake model is built with for ``model.attn_implementation=flash_attention_2`` (without "flash" in it:
transformers would look for the flash-attn package). It has no mask function registered, so transformers hands the
attention the collator's 2D mask as it is and builds no 4D one."""


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


class _FlashMemory(torch.autograd.Function):
    """The tensors of flash-attn's forward and backward (query, key, value: batch x width x heads x head dim)."""

    @staticmethod
    def forward(ctx, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        rows, width, heads, _ = query.shape
        out = torch.empty_like(query)
        log_sum_exp = torch.empty(rows, heads, width, dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, log_sum_exp)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        query, key, value, _, _ = ctx.saved_tensors
        rows, width, heads, head_dim = query.shape
        kv_heads = key.shape[2]
        padded_width = _round_up(width, 128)
        padded_dim = _round_up(head_dim, 32 if head_dim <= 128 else 64)
        # Alive together until the kernel returns: the fp32 accumulator, the row sums, the gradients.
        accumulator = torch.empty(rows, padded_width, heads, padded_dim, dtype=torch.float32)
        row_sums = torch.empty(rows, heads, padded_width, dtype=torch.float32)
        grad_query, grad_key, grad_value = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
        if kv_heads != heads:  # grouped-query attention: per query head first, then summed into each group's
            per_head = [torch.empty(rows, width, heads, head_dim, dtype=t.dtype) for t in (key, value)]
            del per_head
        del accumulator, row_sums
        return grad_query, grad_key, grad_value


def planned_flash_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface (``integrations.flash_attention.flash_attention_forward``): query, key and
    value batch x heads x width x head dim; returns the output batch x width x heads x head dim, and no weights."""
    query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    if query.dtype == torch.float32 and torch.is_autocast_enabled("cpu"):
        # As transformers does for flash (get_target_dtype): fp32 inputs are cast to the autocast dtype first.
        dtype = torch.get_autocast_dtype("cpu")
        query, key, value = (t.to(dtype) for t in (query, key, value))
    return _FlashMemory.apply(query, key, value), None


AttentionInterface.register(PLANNED_FLASH, planned_flash_attention)
