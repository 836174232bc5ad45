"""The round trip of a saved adapter through plain peft (``trainer.save_check``: at the final save; with ``full``, at
every save): it loads as a user would load it, with nothing of ddptrain on the load path, and computes what the
training model computes.

- **The adapter.** ``AutoModelForCausalLM.from_pretrained(<the base in adapter_config.json>)`` then
  ``PeftModel.from_pretrained`` must compute the training model's logits on a fixed probe batch (a few training rows),
  compared without autocast on the attended positions. Both compute the same sums in the same order (the adapters
  load in fp32, as they train): ``LOAD_TOLERANCE``, measured 0.
- **The merged model** (``merge_and_unload``, what ``ddptrain export --merge`` writes) is checked weight by
  weight: it holds no LoRA layer any more, and each adapted weight is the training model's ``W + scale * B @ A``
  rounded to the base's dtype, element by element within ``merge_error``'s bound (derived there from the dtype and
  the rank; the depth does not enter). A merge that lost the adapter, or one layer's, is refused wherever the dtype
  can hold any of it: where an element of ``scale * B @ A`` exceeds about one unit in the last place of the base's
  weight (below that, the right merge is the base's weight too).
- **The merged model's logits** are measured and recorded, not bounded (their NaNs and infinities must be the
  training model's). A bf16 network computed another way (the adapter folded into the weight, rather than added after
  the base's rounded product) moves its logits, through the layers, by as much as a small adapter does: on 8
  random-init bf16 layers of the bundled model, 3.5% to 5.6% of the largest logit whatever the adapter's size, for
  adapters that move them 4.7% to 77% (measured on this project's CPU). No bound on the logits both passes every
  right merge and refuses every lost one there: not the former heuristic ``2 * (layers + 1) * (eps + sqrt(width) *
  eps_fp32)`` of the largest logit (14% at 8 bf16 layers, 45% at Qwen2.5-7B's 28), which passes a merge that
  dropped a 4.7% adapter, nor "closer to the training model than half the bare base is", which refuses that
  adapter's right merge (3.5% against 2.4%).

A failure raises ``SaveCheckError`` naming the file and the difference. A diverged run (NaN or infinite logits in the
training model itself) saves with a warning: its files must then give the same NaNs and infinities in the same places,
and the finite logits and weights within the bounds.

The check runs on every core of the host (``host.all_cores``) and with transformers' own model classes
(``liger.unpatched``: Liger's kernels, patched into the model family for training, fail on the host's tensors). Its
copy of the base loads onto rank 0's device, beside the training model, or onto the host for a GPU run (the device has
no room for a second base; the training model is then mirrored there), in the run's ``model.dtype``. A GPU run with
``trainer.save_check=full`` (``keep_base``) keeps that host copy for the next check while ``MemAvailable`` leaves room
for it (``KEEP_BASE_ROOM``): after the merge each adapted weight gets the training model's back, and the next check
compares every weight with the training model's before it uses the copy; a check that fails lets it go. A CPU run
never keeps it: there it would sit on the training device through every later step, where the memory plan counts it
only while the check runs.
"""

from __future__ import annotations

import copy
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddptrain.evaluation.host import all_cores, mem_available_bytes
from ddptrain.evaluation.readback import ADAPTER_CONFIG, ADAPTER_FILE, SaveCheckError, few_keys, recorded_base
from ddptrain.model.liger import unpatched

log = logging.getLogger("ddptrain.checkpoint")
LOAD_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-3}
"""The adapter loaded onto its base against the training model, max |Δlogit|: both run the same sums in the same
order (the adapters load in fp32 as they train), so any difference is a different model. fp32: 1e-5, absolute;
bf16/fp16: 1e-3 times the largest |logit| (at least 1). Measured: 0 in both (bench/README.md)."""
KEEP_BASE_ROOM = 2.0
"""A GPU run's check keeps its host copy of the base between checks while ``MemAvailable`` is at least this many
times the copy's bytes: as much again left for the rest of the host (data loading, the page cache the checkpoints are
written through). A margin chosen, not derived: no host figure of a GPU run has been measured."""
CHUNK_ELEMENTS = 1 << 22
"""``merge_error`` works through a weight in blocks of rows of about this many elements (16 MiB in float32)."""


def merge_error(
    merged: torch.Tensor, weight: torch.Tensor, left: torch.Tensor, right: torch.Tensor, scale: float
) -> float:
    """How far a merged weight is from ``weight + scale * left @ right``, as the largest share of its bound, element by
    element: at most 1 for a right merge (NaN and infinity must sit where the exact sum has them).

    ``left @ right`` is the adapter's ``B @ A`` (transposed: ``A.T @ B.T``, for ``fan_in_fan_out`` and embeddings).
    With ``x = W + Δ`` the exact sum and ``Δ = scale * B @ A``, the bound is

        ``u_d * (max(|x|, |merged|) + 2|Δ| + tiny_d) + 4 u_a * (|x| + |Δ| + r * scale * |B| @ |A|)``

    where ``u_d`` is the unit roundoff of the merged weight's dtype (2^-8 bf16, 2^-11 fp16, 2^-24 fp32), ``tiny_d`` its
    smallest normal, ``r`` the rank, and ``u_a`` the unit roundoff of the adapter's arithmetic: fp32's (ddptrain's
    adapters train and load in fp32; peft multiplies bf16 or fp16 factors in fp32 on the host), or the factors' dtype's
    where coarser (peft multiplies them in it on a GPU).

    Derivation. peft's merge computes ``P = fl(B @ A)`` (a sum of ``r`` products: ``|P - BA| <= r u_a |B||A|`` to
    first order, Higham's bound), ``D = fl(P * scale)`` (one more ``u_a |D|``) and ``W += D``: the sum rounded in the
    adapter's precision (``u_a |x|``), then to the dtype: at most half an ulp, and half an ulp of a value ``v`` is at
    most ``u_d |v|`` for a normal ``v`` (``u_d * tiny_d`` below that). A merge that rounds ``D`` to the dtype first
    (``safe_merge``) adds at most an ulp of ``|Δ|``: the ``2|Δ|``. The ``u_a`` terms are counted four times over, a
    margin for second-order terms and for this check's own arithmetic. In a bf16 or fp16 base ``u_a`` (fp32's) is 2^16
    or 2^13 times below ``u_d``, so those terms matter only where the sum cancels; in an fp32 base the bound is about
    ``5 u_d |x|``.

    Cost: the check merges the same factors itself, as peft does (the product in fp32, scaled, added to ``W`` in fp32,
    rounded once), block by block on the host; an element whose bits equal that merge meets the bound by the
    derivation above (it is one such rounding of ``x``), and only the elements that differ (none, when peft merges as
    it does today) are measured against the bound, ``x`` in float64. Qwen2.5-0.5B's 168 adapted weights: 0.5 s on
    one thread of this project's CPU, against 2 s for loading the adapter and 1.2 s for each forward of the probe.

    Nothing depends on the depth of the model. A merge that dropped ``Δ`` (``merged == W``) is off by ``|Δ|``: refused
    wherever ``|Δ|`` exceeds about ``u_d |W|`` (a right merge differs from ``W`` once ``|Δ|`` passes half an ulp of
    ``W``: between ``u_d |W| / 2`` and ``u_d |W|``).

    Args:
        merged: the merged model's weight.
        weight: the training model's base weight ``W``.
        left, right: the adapter's factors (``B`` and ``A``, or ``A.T`` and ``B.T``).
        scale: the adapter's scaling (``lora_alpha / r``, or rsLoRA's).
    """
    arith = torch.float32 if left.dtype in (torch.bfloat16, torch.float16) else left.dtype  # peft's, on the host
    u_a = max(torch.finfo(left.dtype).eps, torch.finfo(arith).eps) / 2  # on a GPU peft multiplies in the factors' dtype
    left, right, worst = left.detach().to("cpu", arith), right.detach().to("cpu", arith), 0.0
    rows = max(1, CHUNK_ELEMENTS // max(1, right.shape[1]))
    as_bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[merged.element_size()]
    for i in range(0, left.shape[0], rows):
        got = merged[i : i + rows].detach().to("cpu")
        ours = (left[i : i + rows] @ right).mul_(scale)  # the merge as peft computes it: where its bits are ours, done
        ours += weight[i : i + rows].detach().to("cpu")
        differ = ours.to(merged.dtype).view(as_bits) != got.view(as_bits)
        if differ.any():
            off = differ.nonzero()
            rows_off, cols = off[:, 0] + i, off[:, 1]
            base = weight.detach()[rows_off.to(weight.device), cols.to(weight.device)]
            worst = max(worst, _share(got[off[:, 0], cols], base, left[rows_off], right[:, cols].T, scale, u_a))
    return worst


def _share(
    got: torch.Tensor, weight: torch.Tensor, left: torch.Tensor, right: torch.Tensor, scale: float, u_a: float
) -> float:
    """``merge_error``'s largest share of its bound over some elements: ``got`` and ``weight`` theirs, ``left`` and
    ``right`` the factors' rows that make each (``Δ_k = scale * left_k . right_k``), in float64."""
    finfo = torch.finfo(got.dtype)
    u_d, rank = finfo.eps / 2, left.shape[1]
    lhs, rhs = left.double(), right.double()
    delta, size = (lhs * rhs).sum(1) * scale, (lhs.abs() * rhs.abs()).sum(1) * abs(scale)
    exact, got = weight.to("cpu", torch.float64) + delta, got.double()
    bound = u_d * (torch.maximum(exact.abs(), got.abs()) + 2 * delta.abs() + finfo.tiny)
    bound += 4 * u_a * (exact.abs() + delta.abs() + rank * size)
    share = ((got - exact).abs() / bound).nan_to_num(nan=torch.inf)
    same = (got == exact) | (got.isnan() & exact.isnan())
    return float(torch.where(torch.isfinite(exact), share, torch.where(same, 0.0, torch.inf)).max())


def lora_factors(layer: nn.Module, adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(left, right)`` of a peft LoRA layer: ``scale * left @ right`` is what merging adds to its base weight."""
    if adapter in layer.lora_A:
        b, a = layer.lora_B[adapter].weight, layer.lora_A[adapter].weight
        return (a.T, b.T) if layer.fan_in_fan_out else (b, a)
    return layer.lora_embedding_A[adapter].T, layer.lora_embedding_B[adapter].T  # an embedding: (B @ A).T


MERGE_ADVICE = (
    "ddptrain export --merge would write another model than the one trained; the adapter itself loads as "
    "trained. Export it without --merge, and report this with the versions of peft and transformers."
)


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
        keep_base: keep that host copy of the base for the next check, where host memory allows it (a GPU run with
            ``trainer.save_check=full``); ignored without ``on_cpu``: a CPU run's copy would stay on its device.
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
        self.model, self.probe, self.dtype, self.on_cpu = model, probe, dtype, on_cpu
        self.keep_base = keep_base and on_cpu
        self.attn = "sdpa" if on_cpu and attn_implementation == "flash_attention_2" else attn_implementation
        self.kept: tuple[str, nn.Module] | None = None
        """The host copy of the base kept from the last check that passed, with the path it was loaded from."""
        self.base_loads = 0
        """How many times a check loaded the base (``from_pretrained``)."""

    def __call__(
        self, folders: list[tuple[Path, Path]], whole: dict[str, torch.Tensor] | None = None
    ) -> dict[str, Any]:
        """Check each ``(folder as written, folder as the user will find it)``; the second names the files in errors.
        ``whole``: a sharded model's trainable tensors gathered whole (FSDP2: the training model's own are shards).
        The model is then mirrored on the loaded base as a GPU run's is, from them; the base is not compared with
        the training model's (sharded) and the merged model's weights are not checked one by one (the check reads
        the training model's layers): its logits are measured.

        Returns:
            The record of the check: the folders, the largest logit difference of the adapter, the merged model's
            (measured), the adapted weights of the merged model compared and the largest
            share of its bound any of them used, the threads it ran on, whether it found the base loaded.

        Raises:
            SaveCheckError: naming the file and what is wrong with it.
        """
        with all_cores() as threads, unpatched():
            record = self._check(folders, whole)
        return {**record, "save_check_threads": threads}

    def _check(self, folders: list[tuple[Path, Path]], whole: dict[str, torch.Tensor] | None) -> dict[str, Any]:
        from peft import PeftModel, get_peft_model_state_dict

        live = get_peft_model_state_dict(self.model, state_dict=whole)
        recorded = recorded_base(*folders[0])
        base, was_kept = self._base(recorded, on_host=self.on_cpu or whole is not None)  # None until this passes
        if whole is not None:
            reference = self._mirror_logits(base, live)
        elif self.on_cpu:
            self._check_same_base(base, recorded, folders[0][1])
            reference = self._mirror_logits(base, live)
        else:
            reference = self._logits(self.model)
        self._warn_if_diverged(reference)
        keep = self.keep_base and whole is None and self._room_to_keep(base)
        worst, merged = 0.0, {}
        for k, (folder, shown) in enumerate(folders):
            loaded = PeftModel.from_pretrained(base, str(folder))
            worst = max(worst, self._compare(self._logits(loaded), reference, shown, merged=False))
            if k < len(folders) - 1:
                base = loaded.unload()  # the base as it was: the next folder loads onto it
            else:
                merged, base = self._check_merged(loaded, reference, shown, restore=keep, weights=whole is None)
        self.kept = (recorded, base) if keep else None
        del base, loaded
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the copy of the base is gone: give its memory back before training goes on
        names = [str(shown) for _, shown in folders]
        log.info(
            "save check: %s load in peft as trained (max |Δlogit| %.2g); merged, %d adapted weights as the merge "
            "rounds them (at most %.2g of the bound), its logits %.2g from the training model's%s",
            ", ".join(names),
            worst,
            merged["save_check_merged_weights"],
            merged["save_check_merged_worst_share"],
            merged["save_check_merged_max_abs_diff"],
            ", the base kept for the next check" if keep else "",
        )
        record = {"save_check_round_trip": names, "save_check_max_abs_diff": worst, **merged}
        return {**record, "save_check_base_kept": int(was_kept)}

    def _base(self, recorded: str, on_host: bool) -> tuple[nn.Module, bool]:
        """The copy of the base the adapter names, and whether it was kept from the last check (else it loads now).
        Taking it clears ``kept``: a check that fails half-way (the adapter injected, the merge half done) must not
        leave it for the next."""
        kept, self.kept = self.kept, None
        if kept is not None and kept[0] == recorded:
            return kept[1], True
        del kept  # another base: let the old copy go before the new one loads
        from transformers import AutoModelForCausalLM

        device = torch.device("cpu") if on_host else next(self.model.parameters()).device
        model = AutoModelForCausalLM.from_pretrained(recorded, dtype=self.dtype, attn_implementation=self.attn)
        self.base_loads += 1
        return model.to(device), False

    def _room_to_keep(self, base: nn.Module) -> bool:
        """``MemAvailable`` (with this copy loaded) is at least ``KEEP_BASE_ROOM`` times the copy's bytes."""
        available = mem_available_bytes()
        held = sum(p.numel() * p.element_size() for p in base.parameters())
        return available is not None and available >= KEEP_BASE_ROOM * held

    def _check_merged(
        self, loaded: nn.Module, reference: torch.Tensor, shown: Path, restore: bool, weights: bool = True
    ) -> tuple[dict[str, Any], nn.Module]:
        """Merge the loaded adapter (``merge_and_unload``), check its weights and measure its logits; returns the
        record and the base (with ``restore``, its own weights again: the merge wrote into them).

        Raises:
            SaveCheckError: a LoRA layer left in the merged model, an adapted weight that is not its merge, or
                non-finite logits where the training model's are finite (or the other way round).
        """
        from peft.tuners.tuners_utils import BaseTunerLayer

        merged = loaded.merge_and_unload()
        left = [name for name, m in merged.named_modules() if isinstance(m, BaseTunerLayer)]
        if left:
            raise SaveCheckError(
                f"{shown / ADAPTER_FILE}: merged into its base with plain peft (merge_and_unload), the model still "
                f"holds LoRA layers ({few_keys(left)}). {MERGE_ADVICE}"
            )
        compared, worst = self._check_merged_weights(merged, shown, restore) if weights else (0, 0.0)
        drift = self._compare(self._logits(merged), reference, shown, merged=True)
        record = {
            "save_check_merged_weights": compared,
            "save_check_merged_worst_share": worst,
            "save_check_merged_max_abs_diff": drift,
        }
        return record, merged

    def _check_merged_weights(self, merged: nn.Module, shown: Path, restore: bool) -> tuple[int, float]:
        """Each weight the training model adapts, in the merged model, against the training model's ``W + scale * B
        @ A`` (``merge_error``); with ``restore``, then set back to ``W``. Returns how many and the worst share."""
        from peft.tuners.lora import LoraLayer

        adapter, compared, worst = self.model.active_adapter, 0, 0.0
        for name, layer in self.model.named_modules():
            if not isinstance(layer, LoraLayer):
                continue
            assert not getattr(layer, "lora_variant", None), "a LoRA variant (DoRA) merges otherwise: not built here"
            where = name.removeprefix("base_model.model.")
            target = merged.get_submodule(where).weight
            weight = layer.get_base_layer().weight
            share = merge_error(target, weight, *lora_factors(layer, adapter), layer.scaling[adapter])
            if not share <= 1.0:
                raise SaveCheckError(
                    f"{shown / ADAPTER_FILE}: merged into its base with plain peft (merge_and_unload), {where}.weight "
                    f"is not the training model's W + scale * B @ A rounded to {target.dtype}: it is off by "
                    f"{share:.3g} times the most that merging may round it (peft_check.merge_error). {MERGE_ADVICE}"
                )
            compared, worst = compared + 1, max(worst, share)
            if restore:
                with torch.no_grad():
                    target.copy_(weight)
        return compared, worst

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

    def _compare(self, got: torch.Tensor, reference: torch.Tensor, shown: Path, merged: bool) -> float:
        """The largest |Δlogit| where the training model's logits are finite; where they are not (a diverged run), the
        loaded model must give the same NaN or infinity there: a NaN minus a NaN is no proof of a wrong adapter. The
        adapter must be within ``LOAD_TOLERANCE``; the merged model's difference is measured (its weights are what
        ``_check_merged_weights`` proves)."""
        attended = self.probe.attention_mask.to(reference.device).bool()
        got, reference = got[attended], reference[attended]
        finite = torch.isfinite(reference)
        how = "merged into its base (merge_and_unload)" if merged else "loaded onto its base"
        same_non_finite = (got[~finite] == reference[~finite]) | (got[~finite].isnan() & reference[~finite].isnan())
        if not same_non_finite.all() or not torch.isfinite(got[finite]).all():
            raise SaveCheckError(
                f"{shown / ADAPTER_FILE}: {how} with plain peft, it computes other logits than the training model: "
                "NaN or infinite where the training model's are not, or the other way round, on the probe batch. "
                + (MERGE_ADVICE if merged else "The saved adapter is not the trained one.")
            )
        if not finite.any():
            return 0.0
        diff = float((got[finite] - reference[finite]).abs().max())
        if merged:
            return diff
        scale = max(1.0, float(reference[finite].abs().max()))
        bound = LOAD_TOLERANCE[self.dtype] * (1.0 if self.dtype == torch.float32 else scale)
        if not diff <= bound:
            raise SaveCheckError(
                f"{shown / ADAPTER_FILE}: {how} with plain peft, it computes other logits than the training model: "
                f"max |difference| {diff:.3g} on the probe batch, over the bound {bound:.3g} ({self.dtype}). The saved "
                "adapter is not the trained one."
            )
        return diff
