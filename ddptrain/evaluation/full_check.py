"""The round trip of a full fine-tune's saved model through plain transformers (``trainer.save_check`` with
``model.lora=false``: at the final save; with ``full``, at every save).

A full fine-tune saves the whole model as ``save_pretrained`` writes it (``config.json``, ``model*.safetensors``): the
folder a user hands to ``AutoModelForCausalLM.from_pretrained``. Every save's files are read back bit for bit
(``readback``); the round trip then proves that ``AutoModelForCausalLM.from_pretrained(folder)`` in the run's
``model.dtype`` reports no missing, unexpected or mismatched key and holds every tensor of the training model bit for
bit, ties included: the keys the training model ties (``lm_head.weight`` where the head is the input embedding, as in
the bundled model and Qwen2.5-0.5B: ``save_pretrained`` leaves it out, ``from_pretrained`` ties it back) share one
tensor in the loaded model too, and no others do.

Bit for bit, not logits within a tolerance (the LoRA round trip's way, ``peft_check``): the files are the weights,
copied without arithmetic, so any difference is a defect. The copy loads on the host, one model at a time (the memory
plan counts it on a CPU run: ``plan.budget.save_check_bytes``), on all of its cores and with transformers' own model
classes (``host.all_cores``, ``liger.unpatched``); the training tensors move to the CPU one at a time.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddptrain.checkpoint.files import tied_groups
from ddptrain.evaluation.host import all_cores
from ddptrain.evaluation.readback import SaveCheckError, few_keys, same_bits
from ddptrain.model.liger import unpatched

log = logging.getLogger("ddptrain.checkpoint")


class FullWeightsCheck:
    """Rank 0's round trip of the full weights it writes, through plain transformers.

    Args:
        model: the training model (the transformers model, unwrapped), whose tensors the files must hold.
        dtype: ``model.dtype``: the dtype the copy loads in (the one the run trains in).
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.model, self.dtype = model, dtype

    def __call__(
        self, folders: list[tuple[Path, Path]], whole: dict[str, torch.Tensor] | None = None
    ) -> dict[str, Any]:
        """Check each ``(folder as written, folder as the user will find it)``; the second names the files in errors.

        Returns:
            The record of the check: the folders, the tensors compared in all, the threads it ran on.

        Raises:
            SaveCheckError: naming the file or the key and what is wrong with it.
        """
        live = self.model.state_dict() if whole is None else whole  # whole: a sharded model's, gathered
        compared = 0
        with all_cores() as threads, unpatched():
            for folder, shown in folders:
                compared += compare_loaded(load_plainly(folder, shown, self.dtype), live, shown)
        names = [str(shown) for _, shown in folders]
        log.info("save check: %s load in transformers as trained, bit for bit", ", ".join(names))
        return {"save_check_round_trip": names, "save_check_loaded_tensors": compared, "save_check_threads": threads}


def load_plainly(folder: Path, shown: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The ``state_dict`` of ``AutoModelForCausalLM.from_pretrained(folder)`` on the CPU: what a user gets.

    Raises:
        SaveCheckError: transformers reports a missing, unexpected or mismatched key (it would only warn).
    """
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, output_loading_info=True)
    problems = {name: sorted(map(str, keys)) for name, keys in info.items() if name.endswith("_keys") and keys}
    if problems:
        found = "; ".join(f"{name.replace('_', ' ')} {few_keys(keys)}" for name, keys in problems.items())
        raise SaveCheckError(f"{shown}: AutoModelForCausalLM.from_pretrained loads it with {found}.")
    return model.state_dict()


def compare_loaded(loaded: dict[str, torch.Tensor], live: dict[str, torch.Tensor], shown: Path) -> int:
    """Every tensor of the loaded model equals the training model's bit for bit (a NaN equals the same NaN), and
    the two tie the same keys.

    Returns:
        The number of tensors compared.

    Raises:
        SaveCheckError: naming the first key that differs, or the ties that differ.
    """
    if loaded.keys() != live.keys():
        odd = sorted(loaded.keys() ^ live.keys())
        raise SaveCheckError(f"{shown} loads as another architecture: keys {few_keys(odd)} are in one model only.")
    for key, trained in live.items():
        if not same_bits(loaded[key], trained.detach().cpu()):
            raise SaveCheckError(
                f"{shown}: loaded with plain transformers, {key} is not the trained tensor (dtype, shape or values "
                f"differ: {loaded[key].dtype} {tuple(loaded[key].shape)}, trained {trained.dtype} "
                f"{tuple(trained.shape)}). The saved weights are not the trained ones."
            )
    saved_ties, trained_ties = tied_groups(loaded), tied_groups(live)
    if saved_ties != trained_ties:
        raise SaveCheckError(
            f"{shown}: loaded with plain transformers, it ties {_ties(saved_ties)}; the training model ties "
            f"{_ties(trained_ties)}. Its config.json's tie_word_embeddings does not match the model the run trains."
        )
    return len(live)


def _ties(groups: set[frozenset[str]]) -> str:
    return ", ".join(" = ".join(sorted(g)) for g in sorted(groups, key=sorted)) or "nothing"
