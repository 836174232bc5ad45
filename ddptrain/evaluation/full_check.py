"""Proof that a full fine-tune's saved weights load in plain transformers as trained (``trainer.save_check`` with
``model.lora=false``), and ``build_save_check``, which picks the check of the run's mode.

A full fine-tune saves the whole model as ``save_pretrained`` writes it (``config.json``, ``model*.safetensors``):
the folder a user hands to ``AutoModelForCausalLM.from_pretrained``. After rank 0 writes it (a checkpoint's
``weights/``, ``best/``, ``adapter/``), and before the folder is put in place, it checks:

- the files' keys are the training model's ``state_dict`` keys, canonical (no ``module.`` of DDP, no ``_orig_mod.``
  of torch.compile), none extra, and none missing but a tied one (``lm_head.weight`` where the head is the input
  embedding, as in the bundled model and Qwen2.5-0.5B: ``save_pretrained`` leaves it out, ``from_pretrained`` ties
  it back);
- ``AutoModelForCausalLM.from_pretrained(folder)`` in the run's ``model.dtype`` reports no missing, unexpected or
  mismatched key and holds every tensor of the training model bit for bit, ties included: the keys the training
  model ties share one tensor in the loaded model too, and no others do.

Bit for bit, not logits within a tolerance (the LoRA check's way, ``save_check``): the files are the weights, copied
without arithmetic, so any difference is a defect, and comparing them costs one read of the files. The copy loads
on the host, one model at a time (the memory plan counts it on a CPU run: ``plan.budget.save_check_bytes``); the
training tensors move to the CPU one at a time.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddptrain.checkpoint_files import KNOWN_PREFIXES, tied_groups, untied
from ddptrain.evaluation.save_check import Probe, SaveCheck, SaveCheckError, _few

log = logging.getLogger("ddptrain.checkpoint")
_AS_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class FullWeightsCheck:
    """Rank 0's check of the full weights it writes.

    Args:
        model: the training model (the transformers model, unwrapped), whose tensors the files must hold.
        dtype: ``model.dtype``: the dtype the copy loads in (the one the run trains in).
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.model, self.dtype = model, dtype

    def __call__(self, folders: list[tuple[Path, Path]]) -> dict[str, Any]:
        """Check each ``(folder as written, folder as the user will find it)``; the second names the files in errors.

        Returns:
            The record of the check: its seconds, the tensors compared in all, the folders.

        Raises:
            SaveCheckError: naming the file or the key and what is wrong with it.
        """
        start = time.perf_counter()
        live = self.model.state_dict()
        compared = 0
        for folder, shown in folders:
            check_full_keys(folder, shown, live)
            compared += compare_loaded(load_plainly(folder, shown, self.dtype), live, shown)
        seconds, names = time.perf_counter() - start, [str(shown) for _, shown in folders]
        log.info("save check: %s load in transformers as trained, bit for bit, %.2f s", ", ".join(names), seconds)
        return {"save_check_s": seconds, "save_check_tensors": compared, "save_check_folders": names}


def check_full_keys(folder: Path, shown: Path, live: dict[str, torch.Tensor]) -> None:
    """The safetensors files hold the training model's keys (``live``: its ``state_dict``), canonical, none extra and
    none missing but a copy tied to a saved key.

    Raises:
        SaveCheckError: naming the folder and the keys.
    """
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files or not (folder / "config.json").is_file():
        raise SaveCheckError(f"{shown}: no config.json and *.safetensors: transformers cannot load the weights.")
    keys: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            keys |= set(f.keys())
    wrapped = sorted(k for k in keys if k.startswith(KNOWN_PREFIXES))
    if wrapped:
        raise SaveCheckError(
            f"{shown}: {len(wrapped)} key(s) carry a wrapper's prefix ({_few(wrapped)}): transformers would load "
            "none of them. Save the unwrapped model (no DDP, no torch.compile)."
        )
    missing, extra = untied(live, sorted(live.keys() - keys), keys), sorted(keys - live.keys())
    if missing or extra:
        raise SaveCheckError(
            f"{shown} does not hold this model's weights: missing {_few(missing)} (and tied to no saved key); "
            f"unexpected {_few(extra)}."
        )


def load_plainly(folder: Path, shown: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The ``state_dict`` of ``AutoModelForCausalLM.from_pretrained(folder)`` on the CPU: what a user gets.

    Raises:
        SaveCheckError: transformers reports a missing, unexpected or mismatched key (it would only warn).
    """
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, output_loading_info=True)
    problems = {name: sorted(map(str, keys)) for name, keys in info.items() if name.endswith("_keys") and keys}
    if problems:
        found = "; ".join(f"{name.replace('_', ' ')} {_few(keys)}" for name, keys in problems.items())
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
        raise SaveCheckError(f"{shown} loads as another architecture: keys {_few(odd)} are in one model only.")
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


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors have the same dtype, shape and bits."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        as_int = _AS_INTEGERS[a.element_size()]
        return torch.equal(a.view(as_int), b.view(as_int))
    return torch.equal(a, b)


def _ties(groups: set[frozenset[str]]) -> str:
    return ", ".join(" = ".join(sorted(g)) for g in sorted(groups, key=sorted)) or "nothing"


def build_save_check(
    model: nn.Module, lora: bool, dtype: torch.dtype, attn: str, probe_rows: list[list[int]], pad_id: int, on_gpu: bool
) -> SaveCheck | FullWeightsCheck:
    """The check of the run's mode: peft loads a LoRA adapter and computes the training model's logits on a probe of
    ``probe_rows`` (``SaveCheck``); transformers loads full weights bit for bit (``FullWeightsCheck``).

    Args:
        model: the training model, unwrapped (the peft model for LoRA).
        lora: ``model.lora``.
        dtype: ``model.dtype`` as a torch dtype.
        attn: ``model.attn_implementation``.
        probe_rows: a few training rows (token ids) for the LoRA check's probe batch.
        pad_id: the tokenizer's pad id.
        on_gpu: the run trains on a GPU: the LoRA check loads its copy of the base on the host (the device may have
            no room for a second one); the full check always does.
    """
    if not lora:
        return FullWeightsCheck(model, dtype)
    return SaveCheck(model, Probe.from_rows(list(probe_rows), pad_id), dtype, attn, on_cpu=on_gpu)
