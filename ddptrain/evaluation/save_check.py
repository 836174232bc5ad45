"""Proof that a saved adapter loads and computes what the training model computes (``trainer.save_check``).

After rank 0 writes an adapter (a checkpoint's ``weights/``, ``best/``, ``adapter/``), and before the folder is put
in place, it checks the files as a user would use them, with nothing of ddptrain on the load path:

- the keys are the ones peft saves for this model (``get_peft_model_state_dict``), canonical (no ``module.`` of
  DDP, no ``_orig_mod.`` of torch.compile), none missing and none extra: peft would only warn about them;
- no ``lora_B`` is all zero where the training model's is not (it starts at zero: a zero one is a lost adapter
  that loads "fine"; before its first update, as when fp16's first steps overflow, zero is right);
- ``AutoModelForCausalLM.from_pretrained(<the base in adapter_config.json>)`` then ``PeftModel.from_pretrained``
  computes the training model's logits on a fixed probe batch, and so does the model merged from it
  (``merge_and_unload``, what ``python -m ddptrain.export --merge`` saves).

The base loads once per call (the folders of one call share it: peft's ``unload`` hands it back; a checkpoint and
the ``best/`` copied from it are two calls), onto rank 0's device in the run's ``model.dtype``: one more copy of the
base weights for the duration of the check (the memory plan counts it: ``plan.budget``). Logits are
compared without autocast on the attended positions, within ``LOAD_TOLERANCE`` (the adapter) and
``MERGE_TOLERANCE`` (the merged model) of the dtype. A failure raises ``SaveCheckError`` naming the file and the
difference. A diverged run (NaN or infinite logits in the training model itself) saves with a warning: its files
must then give the same NaNs and infinities in the same places, and the finite logits within the bounds.
"""

from __future__ import annotations

import copy
import json
import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddptrain.checkpoint_files import KNOWN_PREFIXES

log = logging.getLogger("ddptrain.checkpoint")
ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
LOAD_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-3}
"""The adapter loaded onto its base against the training model, max |Δlogit|: both run the same sums in the same
order (the adapters load in fp32 as they train), so any difference is a different model. fp32: 1e-5, absolute;
bf16/fp16: 1e-3 times the largest |logit| (at least 1). Measured: 0 in both (bench/README.md)."""
MERGE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
"""The merged model against the training model, max |Δlogit| over the largest |logit| (at least 1): merging folds
LoRA into the base weights and rounds them to the base's dtype (8 bits of mantissa in bf16, 11 in fp16), so the
merged model computes the same function to that rounding. Measured on the bundled model (logits up to ~6): fp32
9e-6 absolute, bf16 0.11 absolute (2% of the largest logit)."""


class SaveCheckError(RuntimeError):
    """A saved adapter that would not load, or would load and compute something else."""


@dataclass(frozen=True)
class Probe:
    """A fixed batch the logits are compared on: a few training rows, cut short, padded on the right."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor

    @classmethod
    def from_rows(cls, rows: list[list[int]], pad_id: int, max_tokens: int = 32) -> Probe:
        rows = [r[:max_tokens] for r in rows if r]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
        return cls(ids, mask)


class SaveCheck:
    """Rank 0's check of the adapter folders it writes.

    Args:
        model: the training model (the peft model, unwrapped), whose logits the saved files must reproduce.
        probe: the batch to compare on.
        dtype: the base weights' dtype (``model.dtype``): the base loads in it.
        attn_implementation: ``model.attn_implementation``, so both models run the same attention kernel.
        on_cpu: load the copy of the base on the CPU, not beside the training model (a GPU run: its device has no
            room for a second base). The training model is then mirrored there: its peft config and its adapter
            tensors, in memory, on the loaded base, whose every weight must equal the one the run trains on; the
            loaded files are compared with that mirror.
    """

    def __init__(
        self, model: nn.Module, probe: Probe, dtype: torch.dtype, attn_implementation: str, on_cpu: bool = False
    ):
        self.model, self.probe, self.dtype, self.on_cpu = model, probe, dtype, on_cpu
        self.attn = "sdpa" if on_cpu and attn_implementation == "flash_attention_2" else attn_implementation

    def __call__(self, folders: list[tuple[Path, Path]]) -> dict[str, Any]:
        """Check each ``(folder as written, folder as the user will find it)``; the second names the files in errors.

        Returns:
            The record of the check: its seconds, the largest logit difference of the adapter and the merged model.

        Raises:
            SaveCheckError: naming the file and what is wrong with it.
        """
        start = time.perf_counter()
        live = self._live_weights()
        for folder, shown in folders:
            check_keys(folder, shown, live)
        recorded = _recorded_base(*folders[0])
        base = self._load_base(recorded)
        if self.on_cpu:
            self._check_same_base(base, recorded, folders[0][1])
            reference = self._mirror_logits(base, live)
        else:
            reference = self._logits(self.model)
        self._warn_if_diverged(reference)
        worst, merged_diff = 0.0, 0.0
        for k, (folder, shown) in enumerate(folders):
            loaded = _load_adapter(base, folder)
            worst = max(worst, self._compare(self._logits(loaded), reference, shown, merged=False))
            if k < len(folders) - 1:
                base = loaded.unload()  # the base as it was: the next folder loads onto it
            else:
                merged = loaded.merge_and_unload()
                merged_diff = self._compare(self._logits(merged), reference, shown, merged=True)
        del base, loaded
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the copy of the base is gone: give its memory back before training goes on
        seconds, names = time.perf_counter() - start, [str(shown) for _, shown in folders]
        log.info(
            "save check: %s load in peft as trained (max |Δlogit| %.2g, merged %.2g), %.2f s",
            ", ".join(names),
            worst,
            merged_diff,
            seconds,
        )
        return {
            "save_check_s": seconds,
            "save_check_max_abs_diff": worst,
            "save_check_merged_max_abs_diff": merged_diff,
            "save_check_folders": names,
        }

    def _warn_if_diverged(self, reference: torch.Tensor) -> None:
        """Training went on past NaN or infinite weights: the check still proves the files hold what the model holds
        (the same NaNs in the same places), but what it holds is no use, and the user should hear it here too."""
        attended = reference[self.probe.attention_mask.to(reference.device).bool()]
        bad = int((~torch.isfinite(attended)).sum())
        if bad:
            log.warning(
                "save check: %d of the training model's %d logits on the probe batch are NaN or infinite: "
                "the run has diverged (a lower optim.lr or a longer optim.warmup_steps helps); its "
                "adapter is saved as it is.",
                bad,
                attended.numel(),
            )

    def _live_weights(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors as peft saves them, under the keys it saves them (``get_peft_model_state_dict``)."""
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(self.model)

    def _load_base(self, base: str) -> nn.Module:
        from transformers import AutoModelForCausalLM

        device = torch.device("cpu") if self.on_cpu else next(self.model.parameters()).device
        model = AutoModelForCausalLM.from_pretrained(base, dtype=self.dtype, attn_implementation=self.attn)
        return model.to(device)

    def _check_same_base(self, base: nn.Module, recorded: str, shown: Path) -> None:
        """Every weight of the loaded base equals, bit for bit, the one the training model holds (one tensor at a
        time on the CPU): the mirror below is then the training model.

        Raises:
            SaveCheckError: the recorded base is another model.
        """
        training = {
            name.replace(".base_layer", ""): p
            for name, p in self.model.get_base_model().named_parameters()
            if "lora_" not in name
        }
        for name, p in base.named_parameters():
            trained_on = training.get(name)
            if trained_on is None or trained_on.shape != p.shape or not torch.equal(trained_on.detach().cpu(), p):
                raise SaveCheckError(
                    f"{shown / ADAPTER_CONFIG} names the base {recorded}, but its {name} is not the weight the run "
                    "trains on: the adapter would load onto another model."
                )

    def _mirror_logits(self, base: nn.Module, live: dict[str, torch.Tensor]) -> torch.Tensor:
        """The training model's logits, computed on the loaded base: its peft config and adapter tensors put on it
        (then taken off again)."""
        from peft import get_peft_model, set_peft_model_state_dict

        config = copy.deepcopy(self.model.peft_config[self.model.active_adapter])
        with warnings.catch_warnings():  # peft notes the base's new name_or_path: the mirror is never saved
            warnings.filterwarnings("ignore", message=".*base_model_name_or_path.*", category=UserWarning)
            mirror = get_peft_model(base, config, autocast_adapter_dtype=True)
        set_peft_model_state_dict(mirror, {k: v.detach().cpu() for k, v in live.items()})
        logits = self._logits(mirror)
        mirror.unload()
        return logits

    def _logits(self, model: nn.Module) -> torch.Tensor:
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            out = model(input_ids=self.probe.input_ids.to(device), attention_mask=self.probe.attention_mask.to(device))
        model.train(was_training)
        return out.logits.float()

    def _compare(self, got: torch.Tensor, reference: torch.Tensor, shown: Path, merged: bool) -> float:
        """The largest |Δlogit| where the training model's logits are finite; where they are not (a diverged run), the
        loaded model must give the same NaN or infinity there: a NaN minus a NaN is no proof of a wrong adapter."""
        attended = self.probe.attention_mask.to(reference.device).bool()
        got, reference = got[attended], reference[attended]
        finite = torch.isfinite(reference)
        how = "merged into its base (merge_and_unload)" if merged else "loaded onto its base"
        same_non_finite = (got[~finite] == reference[~finite]) | (got[~finite].isnan() & reference[~finite].isnan())
        if not same_non_finite.all() or not torch.isfinite(got[finite]).all():
            raise SaveCheckError(
                f"{shown / ADAPTER_FILE}: {how} with plain peft, it computes other logits than the training model: "
                "NaN or infinite where the training model's are not, or the other way round, on the probe batch. "
                "The saved adapter is not the trained one."
            )
        if not finite.any():
            return 0.0
        diff = float((got[finite] - reference[finite]).abs().max())
        scale = max(1.0, float(reference[finite].abs().max()))
        if merged:
            bound = MERGE_TOLERANCE[self.dtype] * scale
        else:
            absolute = self.dtype == torch.float32
            bound = LOAD_TOLERANCE[self.dtype] * (1.0 if absolute else scale)
        if not diff <= bound:
            raise SaveCheckError(
                f"{shown / ADAPTER_FILE}: {how} with plain peft, it computes other logits than the training model: "
                f"max |difference| {diff:.3g} on the probe batch, over the bound {bound:.3g} ({self.dtype}). "
                "The saved adapter is not the trained one."
            )
        return diff


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
                f"{shown / ADAPTER_FILE}: {len(wrapped)} key(s) carry a wrapper's prefix ({_few(wrapped)}): peft "
                "would load none of them and warn only. Save the unwrapped model (no DDP, no torch.compile)."
            )
        missing, extra = sorted(live.keys() - keys), sorted(keys - live.keys())
        if missing or extra:
            raise SaveCheckError(
                f"{shown / ADAPTER_FILE} does not hold the adapter peft saves for this model: missing "
                f"{_few(missing)}; unexpected {_few(extra)}."
            )
        zero = sorted(k for k in keys if "lora_B" in k and not f.get_tensor(k).any() and live[k].any())
    if zero:
        raise SaveCheckError(
            f"{shown / ADAPTER_FILE}: {len(zero)} lora_B weight(s) are all zero where the training model's are not "
            f"({_few(zero)}): the adapter lost its weights (it would load and do nothing)."
        )


def _recorded_base(folder: Path, shown: Path) -> str:
    """The base model the adapter says it belongs to (``base_model_name_or_path``)."""
    base = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base:
        raise SaveCheckError(f"{shown / ADAPTER_CONFIG} names no base_model_name_or_path: nothing to load it onto.")
    return base


def _load_adapter(base: nn.Module, folder: Path) -> nn.Module:
    from peft import PeftModel

    return PeftModel.from_pretrained(base, str(folder))


def _few(keys: list[str]) -> str:
    if not keys:
        return "none"
    return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
