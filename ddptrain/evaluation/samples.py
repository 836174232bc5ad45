"""Greedy completions of ``trainer.eval_prompts`` at every evaluation, into ``<run>/samples.jsonl`` and the loggers.
Greedy by an explicit generation config, whatever the model ships; a rank's prompts go in left-padded batches.

Each rank completes its share of the prompts (prompt ``i`` on rank ``i % world_size``) with its own unwrapped model:
no collective runs while a rank generates (DDP's forward would sync buffers; ``generate`` on the peft model syncs
nothing), so a rank that generates longer than the others holds nobody up inside generation; one gather afterwards
brings every completion to rank 0, which writes them (the other ranks' metrics logger is a null object).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ddptrain import parallel
from ddptrain.config import DataConfig, TrainerConfig
from ddptrain.data.prompts import PromptRenderer, read_prompts


@dataclass(frozen=True)
class RenderedPrompt:
    """One prompt: as the user gave it (a text or a row) and the token ids it renders to."""

    given: Any
    ids: list[int]


SAMPLE_BATCH_SIZE = 8
"""Prompts a rank completes together (left-padded): a handful of short prompts, a few MB of cache on any model."""


def complete(
    model: nn.Module,
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    stop_ids: list[int],
    pad_id: int,
    device: torch.device,
    batch_size: int = SAMPLE_BATCH_SIZE,
    synced: bool = False,
) -> list[list[int]]:
    """The greedy continuation of each prompt: at most ``max_new_tokens`` tokens, up to and including the first of
    ``stop_ids``. ``batch_size`` prompts at a time, padded on the left, so that every row's next token comes from
    its own last position (the attention mask keeps the padding out, and ``generate`` counts positions from it).
    Greedy whatever the model ships: the settings of its own ``generation_config`` (a ``repetition_penalty``, a
    ``temperature``) are set aside while it generates. No collective (but FSDP2's, with ``synced``: ``model`` is then
    sharded, and every rank runs the same number of forwards): ``model`` is the unwrapped model, run on this rank
    alone. The caller sets eval mode and the autocast."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, use_cache=True, eos_token_id=stop_ids,
        pad_token_id=pad_id,
    )  # fmt: skip
    completions = []
    with torch.no_grad(), _only_these_settings(model):
        for start in range(0, len(prompt_ids), batch_size):
            input_ids, attention_mask = _left_padded(prompt_ids[start : start + batch_size], pad_id, device)
            out = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, generation_config=config, synced_gpus=synced
            )
            completions += [_up_to_stop(row.tolist(), stop_ids) for row in out[:, input_ids.shape[1] :]]
    return completions


@contextlib.contextmanager
def _only_these_settings(model: nn.Module) -> Iterator[None]:
    """``generate`` fills every setting its config leaves unset from the model's ``generation_config``: Qwen2.5-Instruct
    ships ``repetition_penalty=1.05``, others a temperature. A default one stands in while the samples generate."""
    from transformers import GenerationConfig

    generating = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft: the transformers model
    shipped = generating.generation_config
    generating.generation_config = GenerationConfig()
    try:
        yield
    finally:
        generating.generation_config = shipped


def _left_padded(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.tensor([[pad_id] * (width - len(row)) + row for row in rows], device=device)
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows], device=device)
    return ids, mask


def _up_to_stop(tokens: list[int], stop_ids: list[int]) -> list[int]:
    """A row's new tokens up to its first stop token, included: what follows it is padding (the batch went on)."""
    end = next((k for k, token in enumerate(tokens) if token in stop_ids), None)
    return tokens if end is None else tokens[: end + 1]


class SampleRound:
    """The samples of one evaluation, every rank its share, gathered on rank 0.

    Args:
        prompts: the rendered prompts (``data.PromptRenderer``), the same list on every rank.
        max_new_tokens: ``trainer.eval_max_new_tokens``.
        tokenizer: decodes the completions (and gives the pad id).
        stop_ids: the tokens a completion ends at (``data.PromptRenderer.stop_ids``: the EOS, an end-of-turn marker).
        rank, world_size: this rank's share of the prompts.
    """

    def __init__(
        self,
        prompts: list[RenderedPrompt],
        max_new_tokens: int,
        tokenizer: Any,
        stop_ids: list[int],
        rank: int,
        world_size: int,
    ):
        self.prompts, self.max_new_tokens, self.tokenizer, self.stop_ids = prompts, max_new_tokens, tokenizer, stop_ids
        self.mine = list(range(rank, len(prompts), world_size))

    def __call__(
        self,
        model: nn.Module,
        step: int,
        autocast: Callable[[], AbstractContextManager],
        device: torch.device,
        sharded: bool = False,
    ) -> list[dict[str, Any]]:
        """Every prompt's completion at ``step``: the same list on every rank, in prompt order. Every rank calls it:
        the gather at the end is a collective. ``sharded`` (FSDP2): every forward gathers weights from every rank, so
        every rank completes every prompt, in lockstep (the same prompts and weights give the same tokens; generate's
        ``synced_gpus`` keeps a rank that finished stepping until all have), and nothing is gathered."""
        was_training, indices = model.training, range(len(self.prompts)) if sharded else self.mine
        model.eval()
        with autocast():
            ids = complete(
                model,
                [self.prompts[i].ids for i in indices],
                self.max_new_tokens,
                self.stop_ids,
                self.tokenizer.pad_token_id,
                device,
                synced=sharded,
            )
        model.train(was_training)
        mine = [(i, self._row(step, i, tokens)) for i, tokens in zip(indices, ids)]
        if sharded:
            return [row for _, row in mine]
        gathered = sorted((pair for rank in parallel.all_gather_object(mine) for pair in rank), key=lambda p: p[0])
        return [row for _, row in gathered]

    def _row(self, step: int, index: int, tokens: list[int]) -> dict[str, Any]:
        """The completion's text (up to its stop token), its token count, and how it ended: the stop token it wrote
        (``<|im_end|>``, the EOS) or ``max_new_tokens``."""
        end = next((k for k, token in enumerate(tokens) if token in self.stop_ids), None)
        ended = "max_new_tokens" if end is None else self.tokenizer.convert_ids_to_tokens(tokens[end])
        text = self.tokenizer.decode(tokens[:end], skip_special_tokens=True)
        return {
            "step": step,
            "prompt": self.prompts[index].given,
            "completion": text,
            "tokens": len(tokens),
            "ended": ended,
        }


def build_samples(
    cfg: TrainerConfig, data_cfg: DataConfig, tokenizer: Any, rank: int, world_size: int
) -> SampleRound | None:
    """The samples of ``trainer.eval_prompts`` (None without prompts), rendered in the data group's template.

    Raises:
        ValueError: a prompt the template cannot render, or a prompts file that does not parse.
    """
    if cfg.eval_prompts is None:
        return None
    renderer = PromptRenderer(data_cfg, tokenizer)
    prompts = [RenderedPrompt(given, renderer.ids(given)) for given in read_prompts(cfg.eval_prompts)]
    return SampleRound(prompts, cfg.eval_max_new_tokens, tokenizer, renderer.stop_ids(), rank, world_size)
