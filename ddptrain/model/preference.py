"""DPO's loss module (``objective=dpo``): a batch of preference pairs in, the sum of the pairs' losses out.

The collator stacks a micro-batch's pairs as rows: the chosen sequences, then the rejected ones, each labelled on its
reply. Both go through the policy in one forward; each sequence's reply log-probability is the sum of its target
tokens' log-probabilities. The reference is the same model with its LoRA adapter switched off, without gradients,
or its log-probabilities precomputed once (``model/reference.py``) and carried by the batch.
The loss is a sum over pairs: the step divides it by the pairs of the whole global batch (``data.loss_units``), so
its mean is the same whatever the split into ranks and micro-steps.

With m = β·[(log π(chosen) − log π_ref(chosen)) − (log π(rejected) − log π_ref(rejected))]:
sigmoid −log σ(m) (DPO), ipo (m/β − 1/(2β))² on per-token mean log-probabilities (IPO), hinge max(0, 1 − m).
The rewards are β × each reply's log-ratio; at the start (lora_B = 0) policy and reference agree, every reward is 0
and the sigmoid loss is ln 2.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ddptrain import parallel
from ddptrain.config import ObjectiveConfig, PreferenceLossType
from ddptrain.data.encode import IGNORE_INDEX
from ddptrain.model.head_loss import capped

# The log window's sums, in this order (each divided by the window's pairs when logged).
WINDOW = ("rewards_chosen", "rewards_rejected", "rewards_accuracy", "rewards_margin", "logps_chosen", "logps_rejected")


def preference_losses(
    policy: torch.Tensor, reference: torch.Tensor, tokens: torch.Tensor, cfg: ObjectiveConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each pair's loss, and per pair what the log shows (``WINDOW``).

    Args:
        policy: the policy's summed reply log-probabilities, the chosen sequences' then the rejected ones'.
        reference: the same, under the reference.
        tokens: the replies' target tokens, in the same order.
        cfg: the objective group.
    """
    pairs = policy.shape[0] // 2
    if cfg.loss_type == PreferenceLossType.ipo:  # IPO compares per-token means
        policy, reference = policy / tokens, reference / tokens
    ratio = policy - reference
    rewards_chosen, rewards_rejected = cfg.beta * ratio[:pairs], cfg.beta * ratio[pairs:]
    margin = rewards_chosen - rewards_rejected
    if cfg.loss_type == PreferenceLossType.sigmoid:
        losses = -F.logsigmoid(margin)
    elif cfg.loss_type == PreferenceLossType.ipo:
        losses = (margin / cfg.beta - 1 / (2 * cfg.beta)) ** 2
    else:
        losses = torch.relu(1 - margin)
    shown = {
        "rewards_chosen": rewards_chosen,
        "rewards_rejected": rewards_rejected,
        "rewards_accuracy": (rewards_chosen > rewards_rejected).to(policy.dtype),
        "rewards_margin": margin,
        "logps_chosen": policy[:pairs],
        "logps_rejected": policy[pairs:],
    }
    return losses, {name: value.detach() for name, value in shown.items()}


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode (dropout off) for the block, then as it was."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


class PreferenceLoss(nn.Module):
    """The causal LM (``CausalLMLoss``: decoder, head, its soft cap) under DPO's loss; forward returns the pairs'
    loss sum and their count, as ``CausalLMLoss`` returns a token loss sum and the token count."""

    def __init__(self, causal: nn.Module, objective: ObjectiveConfig):
        super().__init__()
        self.causal = causal
        self.objective = objective
        self.window_sums: torch.Tensor | None = None  # [pairs, *WINDOW] since the last log line, on the device

    # The causal LM's parts, as the loss module's (checkpoints, exports, samples, FLOP counts read them).
    model = property(lambda self: self.causal.model)
    decoder = property(lambda self: self.causal.decoder)
    lm_head = property(lambda self: self.causal.lm_head)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        target_index: torch.Tensor | None = None,
        reference_logps: torch.Tensor | None = None,
        reference_only: bool = False,
        **_: Any,
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """The pairs' loss sum and their count; ``reference_only``: the reference's reply log-probabilities alone
        (objective.reference=precomputed's table, ``model/reference.py``), through forward so that a sharded
        model's root gathers its weights as in a step."""
        if reference_only:
            return self.reference_logps(input_ids, labels, attention_mask, target_index)
        losses, shown, tokens = self.pair_losses(input_ids, labels, attention_mask, target_index, reference_logps)
        counts = torch.stack([torch.tensor(float(len(losses)), device=losses.device), tokens.sum()])
        sums = torch.cat([counts, torch.stack([value.sum() for value in shown.values()])]).double()
        # As the log window counts a loss (trainer.on_nonfinite): a micro-batch whose values are not finite is left
        # out, pairs and all, or one NaN would make the window's rewards NaN. On the device: no wait.
        sums = torch.where(torch.isfinite(sums).all(), sums, torch.zeros_like(sums))
        self.window_sums = sums if self.window_sums is None else self.window_sums + sums
        return losses.sum(), torch.tensor(len(losses))

    def pair_losses(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None,
        target_index: Any,
        reference_logps: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """Each pair's loss (with ``objective.sft_weight``'s term), what the log shows of it, and each sequence's
        target tokens. ``reference_logps``: the reference's, precomputed (the batch carries them); else the
        reference runs here."""
        policy, tokens = self.reply_logps(input_ids, labels, attention_mask, target_index)
        if reference_logps is None:
            reference_logps = self.reference_logps(input_ids, labels, attention_mask, target_index)
        losses, shown = preference_losses(policy, reference_logps.to(policy.dtype), tokens, self.objective)
        if self.objective.sft_weight:  # the chosen reply's mean token loss
            pairs = len(losses)
            losses = losses - self.objective.sft_weight * policy[:pairs] / tokens[:pairs]
        return losses, shown, tokens

    @torch.no_grad()
    def reference_logps(
        self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None, target_index: Any
    ) -> torch.Tensor:
        """Each sequence's summed reply log-probability under the reference: the base model, its LoRA adapter
        switched off (a full fine-tune has none: its weights before training are the base), in eval mode (no
        dropout, as TRL does), without gradients."""
        adapter_off = getattr(self.model, "disable_adapter", contextlib.nullcontext)
        with adapter_off(), _evaluating(self.model):
            return self.reply_logps(input_ids, labels, attention_mask, target_index)[0]

    def reply_logps(
        self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None, target_index: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's summed target-token log-probability, and its target tokens (a float tensor)."""
        hidden = self.causal.hidden(input_ids, attention_mask, None)
        if target_index is None:
            row, column = (labels[:, 1:] != IGNORE_INDEX).nonzero(as_tuple=True)
            target_index = row * labels.shape[1] + column
        target_hidden, target_ids = self.causal.targets(hidden, labels, target_index)
        token_logps = self.token_logps(target_hidden, target_ids)
        rows = torch.div(target_index, labels.shape[1], rounding_mode="floor").to(token_logps.device)
        logps = torch.zeros(labels.shape[0], device=token_logps.device).index_add(0, rows, token_logps)
        tokens = torch.zeros_like(logps).index_add(0, rows, torch.ones_like(token_logps))  # bincount would sync
        return logps, tokens

    def token_logps(self, hidden: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        """log p(target) at each target position, ``model.loss_chunk_tokens`` rows at a time: with gradients each
        chunk's (chunk x vocab) logits are recomputed in backward instead of kept."""
        chunk = self.causal.loss_chunk_tokens or max(len(target_ids), 1)
        parts = []
        for start in range(0, len(target_ids), chunk):
            h, t = hidden[start : start + chunk], target_ids[start : start + chunk]
            if torch.is_grad_enabled() and h.requires_grad and chunk < len(target_ids):
                parts.append(checkpoint(self._chunk_logps, h, t, use_reentrant=False))
            else:
                parts.append(self._chunk_logps(h, t))
        return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)

    def _chunk_logps(self, hidden: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        logits = capped(self.causal.lm_head(hidden).float(), self.causal.softcap)
        return logits.log_softmax(-1).gather(1, target_ids[:, None]).squeeze(1)

    @torch.no_grad()
    def eval_sums(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        target_index: torch.Tensor | None = None,
        reference_logps: torch.Tensor | None = None,
        **_: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Evaluation of a batch of pairs: the loss sum, the pairs whose chosen reward is the higher, the pairs."""
        losses, shown, _ = self.pair_losses(input_ids, labels, attention_mask, target_index, reference_logps)
        return losses.sum(), shown["rewards_accuracy"].sum(), len(losses)

    def full_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.causal.full_logits(input_ids, attention_mask)

    def close_window(self) -> dict[str, float | None]:
        """The log window's pairs, their reply tokens and the means of ``WINDOW`` over every rank's pairs (every rank
        calls it: a collective), then a new window. The record's ``loss`` is the mean pair loss."""
        sums = self.window_sums if self.window_sums is not None else torch.zeros(len(WINDOW) + 2, dtype=torch.float64)
        totals = parallel.all_reduce_sum(sums.to(self._device())).tolist()
        self.window_sums = None
        pairs, tokens, means = totals[0], totals[1], totals[2:]
        shown = {name: total / pairs if pairs else None for name, total in zip(WINDOW, means)}
        return {"pairs": int(pairs), "target_tokens": int(tokens), **shown}

    def _device(self) -> torch.device:
        return next(self.causal.parameters()).device
