"""The check every save gets (``trainer.save_check``): the files as written, read back, hold the training model's
trainable tensors bit for bit, under the keys a plain load reads.

- LoRA: ``adapter_model.safetensors`` holds exactly the keys peft saves for the training model
  (``get_peft_model_state_dict``), canonical (no ``module.`` of DDP, no ``_orig_mod.`` of torch.compile), and each
  tensor equals the live one bit for bit (dtype, shape, bits; a NaN equals the same NaN); ``adapter_config.json``
  names the base the run trains on (``base_model_name_or_path``) and the training model's LoRA settings (rank, alpha,
  target modules, ...: what makes the adapter compute the trained function).
- A full fine-tune: the ``*.safetensors`` files hold the training model's ``state_dict`` keys, none extra and none
  missing but a head tied to a saved key, each bit for bit, and ``config.json`` is there.

Bit for bit, not logits within a tolerance: the files are the weights, copied without arithmetic, so any difference
is a defect (one flipped bit is refused), and comparing them costs one read of the files, one tensor at a time (the
live one moved to the host one at a time). Whether plain peft or transformers then loads them and computes the
training model's logits is the round trip (``peft_check``, ``full_check``), which runs at the end or, with
``trainer.save_check=full``, at every save.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddptrain.checkpoint.files import KNOWN_PREFIXES, untied

ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
LORA_FUNCTION_KEYS = (
    "peft_type",
    "r",
    "lora_alpha",
    "target_modules",
    "exclude_modules",
    "use_rslora",
    "use_dora",
    "fan_in_fan_out",
    "bias",
    "modules_to_save",
    "layers_to_transform",
    "layers_pattern",
    "rank_pattern",
    "alpha_pattern",
)
"""The keys of a LoRA config that change what the loaded adapter computes: the saved file must hold the live ones."""
_AS_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class SaveCheckError(RuntimeError):
    """Saved weights that would not load, or would load and compute something else."""


class ReadBack:
    """The exact read-back of a save: rank 0 holds one and calls it on each folder of weights it writes.

    Args:
        model: the training model, unwrapped (the peft model for LoRA, the transformers model for a full fine-tune).
        base: the base an adapter must name in its ``adapter_config.json`` (``checkpoint.files.base_model_path``);
            None for a full fine-tune.
    """

    def __init__(self, model: nn.Module, base: str | None):
        self.model, self.base = model, base
        self.lora = hasattr(model, "peft_config")

    def live(self, whole: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The trainable tensors as a plain load reads them: the adapter's under the keys peft saves them
        (``get_peft_model_state_dict``), or the whole ``state_dict`` of a full fine-tune; from ``whole`` where given
        (a sharded model's trainable tensors gathered whole, by ``state_dict`` key: FSDP2)."""
        if not self.lora:
            return self.model.state_dict() if whole is None else whole
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(self.model, state_dict=whole)

    def __call__(self, folder: Path, shown: Path, whole: dict[str, torch.Tensor] | None = None) -> int:
        """Read ``folder``'s files back and compare them with the live tensors; ``shown`` names the folder in errors
        (where the user will find it).

        Returns:
            The number of tensors compared bit for bit.

        Raises:
            SaveCheckError: naming the file, the key and what is wrong with it.
        """
        live = self.live(whole)
        if self.lora:
            check_keys(folder, shown, live)
            check_adapter_config(folder, shown, self.model, self.base)
            files = [folder / ADAPTER_FILE]
        else:
            files = check_full_keys(folder, shown, live)
        return compare_files(files, live, folder, shown)


def compare_files(files: list[Path], live: dict[str, torch.Tensor], folder: Path, shown: Path) -> int:
    """Every tensor of the safetensors ``files`` equals the live tensor of its key, bit for bit (one at a time).

    Returns:
        The number of tensors compared.

    Raises:
        SaveCheckError: naming the file and the first key that differs.
    """
    from safetensors import safe_open

    compared = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                saved, trained = f.get_tensor(key), live[key].detach().cpu()
                if not same_bits(saved, trained):
                    raise SaveCheckError(
                        f"{shown / file.relative_to(folder)}: {key} as read back is not the trained tensor (saved "
                        f"{saved.dtype} {tuple(saved.shape)}, trained {trained.dtype} {tuple(trained.shape)}, "
                        f"{_bits_differing(saved, trained)}): the file does not hold the weights the run trained. "
                        "Check the storage it was written to (a disk or network file system that changes bytes), and "
                        "resume from the previous checkpoint."
                    )
                compared += 1
    return compared


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors have the same dtype, shape and bits."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        as_int = _AS_INTEGERS[a.element_size()]
        return torch.equal(a.view(as_int), b.view(as_int))
    return torch.equal(a, b)


def _bits_differing(a: torch.Tensor, b: torch.Tensor) -> str:
    """How many elements differ, for the error (dtype or shape differ: said by the caller)."""
    if a.dtype != b.dtype or a.shape != b.shape or not a.is_floating_point():
        return "dtype, shape or values differ"
    as_int = _AS_INTEGERS[a.element_size()]
    return f"{int((a.view(as_int) != b.view(as_int)).sum())} of {a.numel()} elements differ"


def check_keys(folder: Path, shown: Path, live: dict[str, torch.Tensor]) -> None:
    """The adapter file holds exactly the keys peft saves for the training model (``live``: its tensors by key),
    canonical, and no ``lora_B`` all zero where the training model's is not.

    Raises:
        SaveCheckError: naming the file and the keys.
    """
    from safetensors import safe_open

    file = folder / ADAPTER_FILE
    if not file.is_file() or not (folder / ADAPTER_CONFIG).is_file():
        raise SaveCheckError(f"{shown}: no {ADAPTER_FILE} and {ADAPTER_CONFIG}: peft cannot load the adapter.")
    with safe_open(str(file), framework="pt") as f:
        keys = set(f.keys())
        wrapped = sorted(k for k in keys if k.startswith(KNOWN_PREFIXES))
        if wrapped:
            raise SaveCheckError(
                f"{shown / ADAPTER_FILE}: {len(wrapped)} key(s) carry a wrapper's prefix ({few_keys(wrapped)}): peft "
                "would load none of them and warn only. Save the unwrapped model (no DDP, no torch.compile)."
            )
        missing, extra = sorted(live.keys() - keys), sorted(keys - live.keys())
        if missing or extra:
            raise SaveCheckError(
                f"{shown / ADAPTER_FILE} does not hold the adapter peft saves for this model: missing "
                f"{few_keys(missing)}; unexpected {few_keys(extra)}."
            )
        zero = sorted(k for k in keys if "lora_B" in k and not f.get_tensor(k).any() and live[k].any())
    if zero:
        raise SaveCheckError(
            f"{shown / ADAPTER_FILE}: {len(zero)} lora_B weight(s) are all zero where the training model's are not "
            f"({few_keys(zero)}): the adapter lost its weights (it would load and do nothing)."
        )


def recorded_base(folder: Path, shown: Path) -> str:
    """The base model an adapter says it belongs to (``base_model_name_or_path``).

    Raises:
        SaveCheckError: it names none.
    """
    base = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base:
        raise SaveCheckError(f"{shown / ADAPTER_CONFIG} names no base_model_name_or_path: nothing to load it onto.")
    return base


def check_adapter_config(folder: Path, shown: Path, model: nn.Module, base: str | None) -> None:
    """``adapter_config.json`` names ``base`` and holds the training model's LoRA settings (``LORA_FUNCTION_KEYS``).

    Raises:
        SaveCheckError: another base, or settings that would make the loaded adapter compute another function.
    """
    named = recorded_base(folder, shown)
    if base is not None and named != base:
        raise SaveCheckError(
            f"{shown / ADAPTER_CONFIG} names the base {named}, but the run trains on {base}: peft would load the "
            "adapter onto another model. The run writes the base it trains on (model.name_or_path, or <run>/base for "
            "model.init=random): report this with the file."
        )
    saved = json.loads((folder / ADAPTER_CONFIG).read_text())
    trained = model.peft_config[model.active_adapter].to_dict()
    differ = [k for k in LORA_FUNCTION_KEYS if k in trained and _plain(saved.get(k)) != _plain(trained[k])]
    if differ:
        found = ", ".join(f"{k}={saved.get(k)!r} (trained: {_plain(trained[k])!r})" for k in differ)
        raise SaveCheckError(
            f"{shown / ADAPTER_CONFIG} holds {found}: the adapter would load as another function than the one "
            "trained. Save the training model's own peft config (save_pretrained of the unwrapped peft model)."
        )


def _plain(value: Any) -> Any:
    """A config value as compared: enums by value, sets, tuples and lists as sorted lists (JSON keeps a set as a list
    in no set order; none of these settings depends on the order), dicts key by key."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (set, frozenset, tuple, list)):
        return sorted((_plain(v) for v in value), key=repr)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def check_full_keys(folder: Path, shown: Path, live: dict[str, torch.Tensor]) -> list[Path]:
    """The safetensors files hold the training model's keys (``live``: its ``state_dict``), canonical, none extra and
    none missing but a copy tied to a saved key.

    Returns:
        The safetensors files.

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
            f"{shown}: {len(wrapped)} key(s) carry a wrapper's prefix ({few_keys(wrapped)}): transformers would load "
            "none of them. Save the unwrapped model (no DDP, no torch.compile)."
        )
    missing, extra = untied(live, sorted(live.keys() - keys), keys), sorted(keys - live.keys())
    if missing or extra:
        raise SaveCheckError(
            f"{shown} does not hold this model's weights: missing {few_keys(missing)} (and tied to no saved key); "
            f"unexpected {few_keys(extra)}."
        )
    return files


def few_keys(keys: list[str]) -> str:
    """The first three of ``keys`` and how many more, for an error message ("none" when there are none)."""
    if not keys:
        return "none"
    return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
