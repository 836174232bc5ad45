"""The eval metrics over the whole eval split: every rank sums its share (``data.eval_batch_plan``: each row on one
rank), one all-reduce adds the shares up.

Each batch's sums are computed on the same rows whatever the number of ranks, and added up in float64, so one rank
and N ranks report the same eval loss to float64 rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch

from ddptrain import parallel
from ddptrain.model import CausalLMLoss, batch_to_device
from ddptrain.model.preference import PreferenceLoss


def evaluate(
    loss_module: CausalLMLoss,
    batches: Iterable[dict[str, Any]],
    autocast: Callable[[], AbstractContextManager],
    device: torch.device,
) -> dict[str, float]:
    """``eval_loss`` (mean target-token loss), ``eval_perplexity``, ``eval_accuracy`` (the share of target tokens the
    greedy guess gets right) and ``eval_tokens`` over every rank's batches; every rank calls it and gets the same.

    Args:
        loss_module: the model and its loss, unwrapped (no DDP forward: evaluation syncs nothing but the sums).
        batches: this rank's collated eval batches, on the CPU.
        autocast: the run's autocast (``precision.autocast`` bound to its dtype and device).
        device: where the model is.
    """
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss, correct: on the device, read once at the end
    tokens = 0
    was_training = loss_module.training
    loss_module.eval()
    batches, idle = in_lockstep(loss_module, batches)
    with torch.no_grad(), autocast():
        for batch in batches:
            loss_sum, correct, n = loss_module.eval_sums(**batch_to_device(batch, device, compiled=False))
            sums += torch.stack([loss_sum.double(), correct.double()])
            tokens += n
        for batch in idle:  # FSDP2: forwards whose all-gathers the ranks with more batches wait for; not counted
            loss_module.eval_sums(**batch_to_device(batch, device, compiled=False))
    loss_module.train(was_training)
    totals = parallel.all_reduce_sum(torch.cat([sums.cpu(), torch.tensor([float(tokens)], dtype=torch.float64)]))
    loss_sum, correct, n = totals.tolist()
    if isinstance(loss_module, PreferenceLoss):
        return preference_eval_record(loss_sum, correct, int(n))
    return eval_record(loss_sum, correct, int(n))


def in_lockstep(
    loss_module: CausalLMLoss, batches: Iterable[dict[str, Any]]
) -> tuple[Iterable[dict[str, Any]], list[dict[str, Any]]]:
    """This rank's batches, and the forwards it runs after them uncounted so that every rank runs as many: a sharded
    model's (FSDP2) every forward all-gathers each layer's weights from every rank, and the eval split's shards may
    differ by a batch. A replica runs its own batches alone: (``batches``, nothing)."""
    if not parallel.is_sharded(loss_module):
        return batches, []
    mine = list(batches)
    most = max(parallel.all_gather_object(len(mine)))
    spare = (
        mine[-1] if mine else {"input_ids": torch.zeros((1, 1), dtype=torch.long), "labels": torch.full((1, 1), -100)}
    )
    return mine, [spare] * (most - len(mine))


def preference_eval_record(loss_sum: float, wins: float, pairs: int) -> dict[str, float]:
    """objective=dpo: the mean pair loss and the share of pairs whose chosen reply gets the higher reward."""
    if pairs == 0:
        return {"eval_loss": math.nan, "eval_rewards_accuracy": math.nan, "eval_pairs": 0}
    return {"eval_loss": loss_sum / pairs, "eval_rewards_accuracy": wins / pairs, "eval_pairs": pairs}


def eval_record(loss_sum: float, correct: float, tokens: int) -> dict[str, float]:
    """The metrics from the sums over the eval split (no tokens: nan, not a fake 0)."""
    if tokens == 0:
        return {"eval_loss": math.nan, "eval_perplexity": math.nan, "eval_accuracy": math.nan, "eval_tokens": 0}
    loss = loss_sum / tokens
    perplexity = math.exp(loss) if loss < 700 else math.inf  # exp overflows a float past ~709
    return {"eval_loss": loss, "eval_perplexity": perplexity, "eval_accuracy": correct / tokens, "eval_tokens": tokens}
