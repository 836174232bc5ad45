"""The LM head's loss over the target positions, chunk by chunk: the (targets x vocab) logits never exist whole.

``ChunkedHeadLoss`` forms each chunk's gradients in its forward (training); ``chunked_head_eval_sums`` only sums
(evaluation). A model that caps its logits (Gemma 2's ``final_logit_softcapping``: c·tanh(z/c)) gets the cap in both,
and in ``capped``, which the plain (unchunked) path applies.
"""

from __future__ import annotations

import torch


def capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The logits as the model scores them: c·tanh(z/c) under a soft cap c, else as they are."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def _chunk_loss(
    h: torch.Tensor,
    weight: torch.Tensor,
    t: torch.Tensor,
    dtype: torch.dtype,
    count_correct: bool = False,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One chunk's logits in fp32 (capped under ``softcap``), turned in place into exp(logits - row max).

    The GEMM runs in ``dtype`` (the weight's, or autocast's); the cap, max, exp, sum and log in fp32.

    Returns:
        The (chunk x vocab) fp32 buffer of exp(logits - row max), its row sums, the chunk's loss sum, (with
        ``count_correct``: evaluation) how many of its targets the greedy guess gets right (``top1_correct``), and
        under a soft cap tanh(z/c), a second buffer the gradient needs (d c·tanh(z/c) / dz = 1 - tanh²).
    """
    buffer = (h.to(dtype) @ weight.t()).float()
    tanh = None
    if softcap is not None:
        tanh = buffer.div_(softcap).tanh_()
        buffer = tanh * softcap
    target_logit = buffer.gather(1, t[:, None]).squeeze(1)
    correct = top1_correct(buffer, t) if count_correct else None  # an argmax pass: evaluation only
    row_max = buffer.amax(dim=-1, keepdim=True)
    sum_exp = buffer.sub_(row_max).exp_().sum(dim=-1, keepdim=True)
    return buffer, sum_exp, (sum_exp.log() + row_max).squeeze(1).sub_(target_logit).sum(), correct, tanh


def top1_correct(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Targets that are their row's argmax: what greedy decoding picks (of tied logits, the first; a model whose
    logits are all equal gets only the targets that happen to be token 0 right, not all)."""
    return (logits.argmax(dim=-1) == targets).sum()


def _gemm_dtype(weight: torch.Tensor) -> torch.dtype:
    """Autocast's dtype when autocast is on for the weight's device (what ``F.linear`` would use), else the weight's."""
    device = weight.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def chunked_head_eval_sums(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, softcap: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ cross-entropy(hidden @ weightᵀ, targets) and the targets guessed right, without gradients, ``chunk`` rows at
    a time (evaluation).

    At most one (chunk x vocab) fp32 buffer exists at a time; the GEMM runs in autocast's dtype when it is on.
    """
    dtype = _gemm_dtype(weight)
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    correct = torch.zeros((), dtype=torch.int64, device=hidden.device)
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        w = weight.to(dtype)
        for start in range(0, hidden.shape[0], chunk):
            _, _, chunk_loss, chunk_correct, _ = _chunk_loss(
                hidden[start : start + chunk], w, targets[start : start + chunk], dtype, True, softcap
            )
            loss += chunk_loss
            correct += chunk_correct
    return loss, correct


class ChunkedHeadLoss(torch.autograd.Function):
    """Σ cross-entropy(hidden @ weightᵀ, targets), computed ``chunk`` rows at a time.

    For each chunk, forward computes the fp32 logits, the loss, and right away the gradient
    of the loss sum w.r.t. the logits, (softmax − one-hot), which it turns into the gradients
    of ``hidden`` and (if trainable) ``weight`` before dropping the logits. Backward only
    scales those saved gradients. Peak extra memory: one chunk × vocab fp32 tensor (under
    autocast, plus its copy in autocast's dtype, and the weight's copy if the weight is fp32).

    Precision: under autocast the three GEMMs (logits, grad_hidden, grad_weight) run in
    autocast's dtype, as ``F.linear`` would; softmax, log-sum-exp and the sums over chunks
    stay fp32. Without autocast the GEMMs run in the weight's dtype (grad_weight: fp32).
    """

    @staticmethod
    def forward(
        ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, softcap: float | None
    ) -> torch.Tensor:
        autocast = torch.is_autocast_enabled(hidden.device.type)
        dtype = _gemm_dtype(weight)
        w = weight.to(dtype)  # cast once, not once per chunk (a no-op without autocast)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if weight.requires_grad else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk):
                h, t = hidden[start : start + chunk], targets[start : start + chunk]
                # One (chunk x vocab) fp32 buffer, transformed in place: logits -> exp -> softmax -> gradient.
                buffer, sum_exp, chunk_loss, _, tanh = _chunk_loss(h, w, t, dtype, softcap=softcap)
                loss += chunk_loss
                buffer.div_(sum_exp)[torch.arange(len(t), device=t.device), t] -= 1.0  # softmax - one_hot
                if tanh is not None:  # through the cap: times 1 - tanh²(z/c)
                    buffer.mul_(tanh.square_().neg_().add_(1.0))
                grad_logits = buffer.to(dtype)  # the buffer itself when dtype is fp32
                grad_hidden[start : start + chunk] = (grad_logits @ w).to(hidden.dtype)
                if grad_weight is None:
                    continue
                if autocast:  # each chunk's (vocab x hidden) product in autocast's dtype, their sum in fp32
                    grad_weight += grad_logits.t() @ h.to(dtype)
                else:
                    grad_weight.addmm_(buffer.t(), h.float())
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        # Scale in fp32, then cast once: the scale (world_size / tokens) rounded to bf16 is up to 0.4% off.
        scaled_hidden = (grad_hidden.float() * grad_loss.float()).to(grad_hidden.dtype)
        scaled_weight = None if grad_weight is None else (grad_weight * grad_loss).to(ctx.weight_dtype)
        return scaled_hidden, scaled_weight, None, None, None
