"""The round trip of a saved adapter through plain peft (``trainer.save_check``: at the final save; with ``full``, at
every save): it loads as a user would load it, with nothing of ddptrain on the load path, and computes what the
training model computes.

``AutoModelForCausalLM.from_pretrained(<the base in adapter_config.json>)`` then ``PeftModel.from_pretrained`` must
compute the training model's logits on a fixed probe batch (a few training rows), and so must the model merged from
it (``merge_and_unload``, what ``python -m ddptrain.export --merge`` saves). Logits are compared without autocast on
the attended positions. The loaded adapter computes the same sums in the same order as the training model (the
adapters load in fp32, as they train): ``LOAD_TOLERANCE``, measured 0. The merged model rounds each folded weight to
the base's dtype: ``merged_bound`` follows from the dtype and the depth. A failure raises ``SaveCheckError`` naming
the file and the difference. A diverged run (NaN or infinite logits in the training model itself) saves with a
warning: its files must then give the same NaNs and infinities in the same places, and the finite logits within the
bounds.

The check runs on every core of the host (``host.all_cores``: torchrun leaves each process one thread) and with
transformers' own model classes (``host.unpatched``: Liger's kernels, patched into the model family for training,
fail on the host's tensors). Its copy of the base loads onto rank 0's device, or onto the host for a GPU run (the
device has no room for a second base; the training model is then mirrored there), in the run's ``model.dtype``.
With ``keep_base`` it stays loaded for the next check while ``MemAvailable`` leaves room for it twice over
(``KEEP_BASE_ROOM``); the merge writes into its weights, so they are copied first and put back after.
"""

from __future__ import annotations

import copy
import logging
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddptrain.evaluation.host import all_cores, mem_available_bytes, unpatched
from ddptrain.evaluation.readback import ADAPTER_CONFIG, ADAPTER_FILE, SaveCheckError, recorded_base

log = logging.getLogger("ddptrain.checkpoint")
LOAD_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-3}
"""The adapter loaded onto its base against the training model, max |Δlogit|: both run the same sums in the same
order (the adapters load in fp32 as they train), so any difference is a different model. fp32: 1e-5, absolute;
bf16/fp16: 1e-3 times the largest |logit| (at least 1). Measured: 0 in both (bench/README.md)."""
HEADROOM = 2.0
"""Two computations are compared (the training model and the merged one): each carries its own rounding."""
KEEP_BASE_ROOM = 2.0
"""``keep_base`` keeps the copy of the base between checks while ``MemAvailable`` is at least this many times its
bytes: room for the next check's copy of the weights the merge overwrites, and for everything else."""


def merged_bound(dtype: torch.dtype, layers: int, width: int) -> float:
    """The largest |Δlogit| allowed between the merged model and the training model, as a share of the largest |logit|
    (at least 1): ``HEADROOM * (layers + 1) * (eps(dtype) + sqrt(width) * eps(float32))``.

    Derivation. Merging folds ``scale * B @ A`` into each adapted weight and rounds the sum to the base's dtype once:
    a relative error of at most u = eps/2 per weight (2^-8 in bf16, 2^-11 in fp16, 2^-24 in fp32), which moves each
    projection's output by at most u of its size; the output is rounded to the dtype in both models, at other points
    (the training model rounds the base's product, then the sum with the fp32 adapter; the merged model its one
    product): another u. So each decoder layer may add up to 2u = eps of relative error to the residual stream, and
    its sums run in another order (the adapter's product added apart or folded in: ``sqrt(width)`` units of fp32's
    eps, the accumulation dtype, for ``width`` terms; ``tests/numerics.py``). The residual stream carries each layer's
    error to the end with unit gain (pre-norm layers add to it), and in the worst case they add up in the same
    direction: ``layers`` of them, one more for the final norm and the head, ``HEADROOM`` for the two models.
    Measured with the check's probe on random-init copies of the bundled model (1 to 24 layers, every linear or q and
    v adapted): 32-40% of the bound in bf16 at 1-8 layers, 18% at 24; 23-44% in fp16; 3-19% in fp32 (the errors add
    more like a random walk than in the worst case). The former fixed bound, 5% of the largest logit in bf16, refuses
    the healthy 8-layer merge (5.6%). Qwen2.5-7B in bf16 (28 layers): 45% of the largest logit, where a merge that
    lost the adapter moves the logits by the adapter's whole effect.

    Args:
        dtype: the base's dtype (``model.dtype``).
        layers: decoder layers holding adapted projections (``num_hidden_layers``).
        width: the widest input of an adapted projection (``intermediate_size`` for the MLP's down projection).
    """
    per_layer = torch.finfo(dtype).eps + math.sqrt(width) * torch.finfo(torch.float32).eps
    return HEADROOM * (layers + 1) * per_layer


@dataclass(frozen=True)
class Probe:
    """A fixed batch the logits are compared on: a few training rows, cut short, padded on the right."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor

    @classmethod
    def from_rows(cls, rows: list[list[int]], pad_id: int, max_tokens: int = 32) -> Probe:
        """The probe of ``rows`` (token ids), each cut to ``max_tokens``, padded with ``pad_id``."""
        rows = [r[:max_tokens] for r in rows if r]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
        return cls(ids, mask)


class PeftRoundTrip:
    """Rank 0's round trip of the adapter folders it writes, through plain peft.

    Args:
        model: the training model (the peft model, unwrapped), whose logits the saved files must reproduce.
        probe: the batch to compare on.
        dtype: the base weights' dtype (``model.dtype``): the base loads in it.
        attn_implementation: ``model.attn_implementation``, so both models run the same attention kernel.
        on_cpu: load the copy of the base on the CPU, not beside the training model (a GPU run: its device has no
            room for a second base). The training model is then mirrored there: its peft config and its adapter
            tensors, in memory, on the loaded base, whose every weight must equal the one the run trains on; the
            loaded files are compared with that mirror.
        keep_base: keep the copy of the base loaded for the next check, where host memory allows it (the check runs
            at every save: ``trainer.save_check=full``).
    """

    def __init__(
        self,
        model: nn.Module,
        probe: Probe,
        dtype: torch.dtype,
        attn_implementation: str,
        on_cpu: bool = False,
        keep_base: bool = False,
    ):
        self.model, self.probe, self.dtype, self.on_cpu, self.keep_base = model, probe, dtype, on_cpu, keep_base
        self.attn = "sdpa" if on_cpu and attn_implementation == "flash_attention_2" else attn_implementation
        self.kept: tuple[str, nn.Module] | None = None
        """The copy of the base kept from the last check, with the path it was loaded from."""
        self.base_loads = 0
        """How many times a check loaded the base (``from_pretrained``)."""

    def __call__(self, folders: list[tuple[Path, Path]]) -> dict[str, Any]:
        """Check each ``(folder as written, folder as the user will find it)``; the second names the files in errors.

        Returns:
            The record of the check: the folders, the largest logit difference of the adapter and of the merged
            model, the merged model's bound (absolute), the threads it ran on, whether it found the base loaded.

        Raises:
            SaveCheckError: naming the file and what is wrong with it.
        """
        with all_cores() as threads, unpatched():
            record = self._check(folders)
        return {**record, "save_check_threads": threads}

    def _check(self, folders: list[tuple[Path, Path]]) -> dict[str, Any]:
        from peft import get_peft_model_state_dict

        live = get_peft_model_state_dict(self.model)
        recorded = recorded_base(*folders[0])
        base, was_kept = self._base(recorded)
        if self.on_cpu:
            self._check_same_base(base, recorded, folders[0][1])
            reference = self._mirror_logits(base, live)
        else:
            reference = self._logits(self.model)
        self._warn_if_diverged(reference)
        worst, merged_diff, bound = 0.0, 0.0, 0.0
        keep = self.keep_base and self._room_to_keep(base)
        for k, (folder, shown) in enumerate(folders):
            from peft import PeftModel

            loaded = PeftModel.from_pretrained(base, str(folder))
            worst = max(worst, self._compare(self._logits(loaded), reference, shown, merged=False)[0])
            if k < len(folders) - 1:
                base = loaded.unload()  # the base as it was: the next folder loads onto it
            else:
                merged_diff, bound, base = self._check_merged(loaded, reference, shown, keep)
        self.kept = (recorded, base) if keep else None
        del base, loaded
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the copy of the base is gone: give its memory back before training goes on
        names = [str(shown) for _, shown in folders]
        log.info(
            "save check: %s load in peft as trained (max |Δlogit| %.2g, merged %.2g of at most %.2g)%s",
            ", ".join(names),
            worst,
            merged_diff,
            bound,
            ", the base kept for the next check" if keep else "",
        )
        return {
            "save_check_round_trip": names,
            "save_check_max_abs_diff": worst,
            "save_check_merged_max_abs_diff": merged_diff,
            "save_check_merged_bound": bound,
            "save_check_base_kept": int(was_kept),
        }

    def _base(self, recorded: str) -> tuple[nn.Module, bool]:
        """The copy of the base the adapter names: the one kept from the last check when it is that base, else
        loaded now; and whether it was kept."""
        if self.kept is not None and self.kept[0] == recorded:
            return self.kept[1], True
        self.kept = None  # another base: let the old copy go before the new one loads
        from transformers import AutoModelForCausalLM

        device = torch.device("cpu") if self.on_cpu else next(self.model.parameters()).device
        model = AutoModelForCausalLM.from_pretrained(recorded, dtype=self.dtype, attn_implementation=self.attn)
        self.base_loads += 1
        return model.to(device), False

    def _room_to_keep(self, base: nn.Module) -> bool:
        """``MemAvailable`` (with this copy loaded) is at least ``KEEP_BASE_ROOM`` times the copy's bytes."""
        available = mem_available_bytes()
        held = sum(p.numel() * p.element_size() for p in base.parameters())
        return available is not None and available >= KEEP_BASE_ROOM * held

    def _check_merged(
        self, loaded: nn.Module, reference: torch.Tensor, shown: Path, keep: bool
    ) -> tuple[float, float, nn.Module]:
        """The merged model against the training model; returns the difference, the bound (absolute) and the base
        (its own weights again when it is kept: the merge folds the adapter into them)."""
        from peft.tuners.lora import LoraLayer

        layers = [m for m in loaded.modules() if isinstance(m, LoraLayer)]
        width = max(m.in_features for m in layers)
        saved = [(m.get_base_layer(), m.get_base_layer().weight.detach().clone()) for m in layers] if keep else []
        merged = loaded.merge_and_unload()
        relative = merged_bound(self.dtype, merged.config.num_hidden_layers, width)
        diff, bound = self._compare(self._logits(merged), reference, shown, merged=True, relative=relative)
        with torch.no_grad():
            for layer, weight in saved:
                layer.weight.copy_(weight)
        return diff, bound, merged

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

    def _compare(
        self, got: torch.Tensor, reference: torch.Tensor, shown: Path, merged: bool, relative: float = 0.0
    ) -> tuple[float, float]:
        """The largest |Δlogit| where the training model's logits are finite, and its bound (the merged model's:
        ``relative`` times the largest |logit|); where they are not (a diverged run), the loaded model must give the
        same NaN or infinity there: a NaN minus a NaN is no proof of a wrong adapter."""
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
            return 0.0, 0.0
        diff = float((got[finite] - reference[finite]).abs().max())
        scale = max(1.0, float(reference[finite].abs().max()))
        if merged:
            bound = relative * scale
        else:
            bound = LOAD_TOLERANCE[self.dtype] * (1.0 if self.dtype == torch.float32 else scale)
        if not diff <= bound:
            what = f"the bound of a merge in {self.dtype} (peft_check.merged_bound)" if merged else "the bound"
            raise SaveCheckError(
                f"{shown / ADAPTER_FILE}: {how} with plain peft, it computes other logits than the training model: "
                f"max |difference| {diff:.3g} on the probe batch, over {what} {bound:.3g} ({self.dtype}). "
                + (
                    "python -m ddptrain.export --merge would write another model than the one trained; the adapter "
                    "itself loads as trained. Export it without --merge, and report this with the versions of peft "
                    "and transformers."
                    if merged
                    else "The saved adapter is not the trained one."
                )
            )
        return diff, bound
