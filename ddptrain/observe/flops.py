"""Model FLOPs of a training micro-batch, and the device's peak, for ``tflops`` and ``mfu``.

Model FLOPs are the multiply-adds the model needs to train on a batch (2 FLOPs each), counted
from the architecture (the transformers config) and from which weights train (LoRA adapters,
or every weight in a full fine-tune). They do not depend on how the run computes them: work
the hardware does on top (padding, attention across a packed row, gradient checkpointing's
recomputation) is not counted, so ``mfu`` falls when that overhead grows. docs/flops.md has
the derivation; in short, with d = hidden size, H / KV = query / key-value heads, h = head
dim, I = intermediate size, V = vocabulary, r = LoRA rank:

- A linear map in -> out costs 2·in·out per token forward. Backward costs 2·in·out for the
  input gradient, only where autograd needs it (the input depends on a trainable weight), and
  2·in·out for the weight gradient, only for a trainable weight. Each decoder layer has
  q (d -> H·h), k and v (d -> KV·h), o (H·h -> d), gate and up (d -> I), down (I -> d).
- A LoRA adapter on a projection adds A (in -> r) and B (r -> out), counted the same way:
  both weights train, and B's input (A's output) always needs its gradient.
- Attention, per layer and per sample of length L: QKᵀ and AV cost 2·H·h·L² each forward
  (GQA shares K and V between heads, not the products). Backward computes dP (if Q or K needs
  a gradient), dV, dQ and dK (each if needed), 2·H·h·L² each: 8·H·h·L² in the usual case.
  The full L×L product is counted, not the causal half, as PaLM's MFU, torchtitan and
  torch.utils.flop_counter do, so ``mfu`` compares with the numbers those report.
- The LM head (d -> V) runs only on target tokens (``CausalLMLoss.target_loss``).
- Elementwise work (norms, activations, rotary, softmax, the loss) is not counted: it is a
  small share of a transformer's FLOPs and not what its peak measures.

Input gradients below the lowest trainable weight are not needed: with a frozen embedding,
layer 0's q/k/v inputs need none (their LoRA adapters train, but their input is the frozen
embedding's output). Gradient checkpointing (``enable_input_require_grads``) makes the
embedding output require grad, so autograd then computes those gradients too; like the
recomputation, that is checkpointing's cost, not the model's, and is not counted: the count
is the same with gradient checkpointing on or off.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ddptrain.config import DType
from ddptrain.data.encode import IGNORE_INDEX

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Projection:
    """One linear map of a decoder layer as it trains: a base weight and an optional LoRA pair."""

    in_features: int
    out_features: int
    base_trainable: bool = False
    lora_rank: int = 0  # summed over the active adapters; 0 = no adapter

    @property
    def trainable(self) -> bool:
        """Whether the output depends on a trainable weight (then everything after it needs gradients)."""
        return self.base_trainable or self.lora_rank > 0

    def forward_flops(self) -> int:
        """Per token: the base map, then A and B."""
        i, o, r = self.in_features, self.out_features, self.lora_rank
        return 2 * i * o + 2 * i * r + 2 * r * o

    def backward_flops(self, input_needs_grad: bool) -> int:
        """Per token: input gradients where autograd needs them, weight gradients for trainable weights.

        Args:
            input_needs_grad: the projection's input depends on a trainable weight.

        Returns:
            FLOPs per token of this projection's backward.
        """
        i, o, r = self.in_features, self.out_features, self.lora_rank
        flops = 2 * i * o * (input_needs_grad + self.base_trainable)
        if r:
            # A: input gradient if needed, weight gradient; B: input gradient (A trains) and weight gradient.
            flops += 2 * i * r * (input_needs_grad + 1) + 2 * r * o * 2
        return flops


@dataclass(frozen=True)
class Layer:
    """A Llama-style decoder layer's projections, in the order data flows through them."""

    q: Projection
    k: Projection
    v: Projection
    o: Projection
    gate: Projection
    up: Projection
    down: Projection

    def projections(self) -> tuple[Projection, ...]:
        return (self.q, self.k, self.v, self.o, self.gate, self.up, self.down)


# Where each projection sits in a transformers decoder layer (Llama, Qwen2/3, Mistral, Gemma, ...).
PROJECTION_PATHS = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


@dataclass(frozen=True)
class LayerFlops:
    """Per-token linear FLOPs and per-L² attention FLOPs of one layer, and whether its output needs grad."""

    linear_forward: int
    linear_backward: int
    attention_forward: int
    attention_backward: int
    output_needs_grad: bool


def layer_flops(layer: Layer, input_needs_grad: bool, heads: int, head_dim: int) -> LayerFlops:
    """Follow one layer's data flow: each input needs a gradient once anything before it trains.

    Args:
        layer: the layer's projections.
        input_needs_grad: the layer's input (the residual stream) depends on a trainable weight.
        heads: query heads (H).
        head_dim: per-head width (h).

    Returns:
        The layer's FLOPs; attention's per unit of Σ L² over the batch's samples.
    """
    grad = input_needs_grad
    backward = sum(p.backward_flops(grad) for p in (layer.q, layer.k, layer.v))
    q_grad, k_grad, v_grad = (grad or p.trainable for p in (layer.q, layer.k, layer.v))
    # dP = dOut·Vᵀ feeds dQ and dK; dV = Pᵀ·dOut; dQ = dS·K; dK = dSᵀ·Q.
    attention_matmuls = (q_grad or k_grad) + v_grad + q_grad + k_grad
    grad = q_grad or k_grad or v_grad
    backward += layer.o.backward_flops(grad)
    grad = grad or layer.o.trainable  # the residual stream after attention
    backward += layer.gate.backward_flops(grad) + layer.up.backward_flops(grad)
    grad = grad or layer.gate.trainable or layer.up.trainable
    backward += layer.down.backward_flops(grad)
    per_product = 2 * heads * head_dim  # one L×L×h product over all query heads, per unit of L²
    return LayerFlops(
        linear_forward=sum(p.forward_flops() for p in layer.projections()),
        linear_backward=backward,
        attention_forward=2 * per_product,
        attention_backward=attention_matmuls * per_product,
        output_needs_grad=grad or layer.down.trainable,
    )


@dataclass(frozen=True)
class TokenCounts:
    """What a micro-batch's FLOPs depend on."""

    tokens: int  # real tokens (not padding)
    squared_lengths: int  # Σ L² over samples (each packed segment is a sample)
    targets: int  # tokens the LM head runs on


def token_counts(batch: dict[str, Any]) -> TokenCounts:
    """Real tokens, Σ L² and target tokens of a collated micro-batch (``data.Collator``), on the CPU.

    Packed rows carry position_ids that restart at 0 for each sample and count up by one, so a
    sample of length L contributes Σ_{p<L} (2p + 1) = L²: one reduction, no loop over samples.
    Padded rows carry an attention mask (1 = real token).

    Args:
        batch: the collator's output.

    Returns:
        The counts; without position_ids or attention_mask every position is a real token.
    """
    if "position_ids" in batch:
        positions = batch["position_ids"]
        tokens, squared = positions.numel(), int((2 * positions + 1).sum())
    elif "attention_mask" in batch:
        lengths = batch["attention_mask"].sum(dim=1)
        tokens, squared = int(lengths.sum()), int(lengths.square().sum())
    else:
        rows, width = batch["input_ids"].shape
        tokens, squared = rows * width, rows * width * width
    if "target_index" in batch:
        targets = batch["target_index"].numel()
    else:  # the loss module's own rule: positions whose next label is a target
        targets = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    return TokenCounts(tokens, squared, targets)


@dataclass(frozen=True)
class ModelFlops:
    """FLOPs of the model's forward and backward per real token, per unit of Σ L², per target token."""

    linear_forward: int
    linear_backward: int
    attention_forward: int
    attention_backward: int
    head_forward: int
    head_backward: int
    base_linear_forward: int = 0  # per token, the projections without their adapters: DPO's adapter-off reference

    @classmethod
    def from_model(cls, loss_module: nn.Module) -> ModelFlops:
        """Read the architecture from the transformers config and what trains from the parameters.

        Args:
            loss_module: ``model.build_model``'s ``CausalLMLoss`` (not the DDP or compiled wrapper).

        Returns:
            The model's FLOP coefficients.

        Raises:
            ValueError: a decoder layer without the Llama-style projections, a projection whose
                shape is not the config's, or a LoRA adapter somewhere this count does not cover.
        """
        decoder = loss_module.decoder
        config = decoder.config
        d, heads = config.hidden_size, config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or d // heads
        shapes = _projection_shapes(d, heads, config.num_key_value_heads, head_dim, config.intermediate_size)
        seen: set[nn.Module] = set()
        grad = decoder.get_input_embeddings().weight.requires_grad  # a full fine-tune trains the embedding
        totals, base = [0, 0, 0, 0], 0
        for index, module in enumerate(decoder.layers):
            layer = Layer(**{k: _projection(module, index, k, shapes[k], seen) for k in PROJECTION_PATHS})
            flops = layer_flops(layer, grad, heads, head_dim)
            parts = (flops.linear_forward, flops.linear_backward, flops.attention_forward, flops.attention_backward)
            totals = [t + p for t, p in zip(totals, parts)]
            base += sum(2 * p.in_features * p.out_features for p in layer.projections())
            grad = flops.output_needs_grad
        _check_adapters_counted(loss_module, seen)
        head = loss_module.lm_head.weight
        if tuple(head.shape) != (config.vocab_size, d):
            raise ValueError(f"flops: the LM head is {tuple(head.shape)}, not (vocab_size, hidden_size).")
        head_flops = 2 * d * config.vocab_size
        # The head's input gradient flows into the trainable layers; its weight gradient only in a full fine-tune.
        return cls(*totals, head_flops, head_flops * (grad + head.requires_grad), base)

    def forward_backward_flops(self, batch: dict[str, Any]) -> tuple[int, int]:
        """Model FLOPs of one collated micro-batch's forward and of its backward. A batch of preference pairs
        without their reference log-probabilities (objective=dpo, objective.reference=adapter_off) adds the
        reference's forward to the forward's: the work the step does.

        Args:
            batch: the collator's CPU tensors (padded, or packed with position_ids).

        Returns:
            (forward, backward) FLOPs, real tokens only.
        """
        n = token_counts(batch)
        forward = (
            n.tokens * self.linear_forward + n.squared_lengths * self.attention_forward + n.targets * self.head_forward
        )
        backward = (
            n.tokens * self.linear_backward
            + n.squared_lengths * self.attention_backward
            + n.targets * self.head_backward
        )
        if "pairs" in batch and "reference_logps" not in batch:  # DPO's reference ran: the base, adapters off
            forward += (
                n.tokens * self.base_linear_forward
                + n.squared_lengths * self.attention_forward
                + n.targets * self.head_forward
            )
        return forward, backward

    def batch_flops(self, batch: dict[str, Any]) -> int:
        """Forward + backward model FLOPs of one collated micro-batch (real tokens only).

        Args:
            batch: the collator's CPU tensors (padded, or packed with position_ids).

        Returns:
            The FLOPs; a few CPU tensor reductions, no loop over samples.
        """
        return sum(self.forward_backward_flops(batch))


class UncountedFlops:
    """A model this count does not cover (not a Llama-style decoder): no FLOPs, so tflops and mfu log null."""

    def batch_flops(self, batch: dict[str, Any]) -> int:
        return 0


def build_model_flops(loss_module: nn.Module, enabled: bool = True) -> ModelFlops | UncountedFlops:
    """The model's FLOP count, or, for an architecture it cannot read, a warning and no count (training goes on).

    Args:
        enabled: trainer.timing; without it nothing reads the count, so none is made or kept per micro-batch.
    """
    if not enabled:
        return UncountedFlops()
    try:
        return ModelFlops.from_model(loss_module)
    except (ValueError, AttributeError) as err:
        log.warning("tflops and mfu will be null: cannot count this model's FLOPs (%s)", err)
        return UncountedFlops()


def _projection_shapes(
    d: int, heads: int, kv_heads: int, head_dim: int, intermediate: int
) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection, from the config."""
    return {
        "q": (d, heads * head_dim),
        "k": (d, kv_heads * head_dim),
        "v": (d, kv_heads * head_dim),
        "o": (heads * head_dim, d),
        "gate": (d, intermediate),
        "up": (d, intermediate),
        "down": (intermediate, d),
    }


def _projection(layer: nn.Module, index: int, key: str, shape: tuple[int, int], seen: set) -> Projection:
    """One projection of a decoder layer: its shape (checked against the config), what trains, the LoRA rank."""
    path = PROJECTION_PATHS[key]
    try:
        module = layer.get_submodule(path)
    except AttributeError:
        raise ValueError(
            f"flops: decoder layer {index} has no {path}; only Llama-style layers (q/k/v/o_proj, "
            "gate/up/down_proj) are counted."
        ) from None
    base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
    if (base.in_features, base.out_features) != shape:
        raise ValueError(
            f"flops: layer {index} {path} maps {base.in_features} -> {base.out_features}, but the config "
            f"implies {shape[0]} -> {shape[1]}: this architecture is not counted correctly."
        )
    seen.add(module)
    rank = sum(module.lora_A[name].out_features for name in _active_adapters(module))
    return Projection(*shape, base_trainable=base.weight.requires_grad, lora_rank=rank)


def _active_adapters(module: nn.Module) -> list[str]:
    """The LoRA adapters a peft layer runs (none for a plain linear layer)."""
    if not hasattr(module, "lora_A"):
        return []
    return [name for name in module.active_adapters if name in module.lora_A]


def _check_adapters_counted(loss_module: nn.Module, seen: set[nn.Module]) -> None:
    """Refuse LoRA adapters outside the projections counted (e.g. on the LM head or the embedding)."""
    stray = [name for name, m in loss_module.named_modules() if m not in seen and _active_adapters(m)]
    if stray:
        raise ValueError(
            f"flops: LoRA adapters on {', '.join(stray)} are not counted (only the attention and MLP "
            "projections are): list only those in model.lora_target_modules."
        )


# ----------------------------------------------------------------------------- peak


@dataclass(frozen=True)
class GpuPeak:
    """Dense peak TFLOP/s (no sparsity) of one GPU; None where it has no such tensor-core path."""

    bf16: float | None
    fp16: float
    tf32: float | None
    fp32: float


# Dense peaks: NVIDIA datasheets quote tensor-core figures "with sparsity" (2:4), twice the dense rate;
# the numbers below are the dense ones. Matched against torch.cuda.get_device_name in order, so a more
# specific name comes before a shorter one it contains ("H100 NVL" before "H100"; word boundaries keep
# "A10" from matching "A100" and "L4" from matching "L40S").
GPU_PEAKS: list[tuple[str, GpuPeak]] = [
    # H200 datasheet: SXM BF16/FP16 1,979 and TF32 989 sparse, FP32 67; NVL 1,671 / 835 sparse, FP32 60.
    # GH200 carries the same Hopper GPU as H200 SXM (GH200 datasheet: BF16 1,979 sparse).
    (r"\bH200 NVL\b", GpuPeak(835.5, 835.5, 417.5, 60.0)),
    (r"\bG?H200\b", GpuPeak(989.5, 989.5, 494.5, 67.0)),
    # H100 datasheet: SXM 1,979 / 989 sparse, FP32 67; PCIe 1,513 / 756 sparse, FP32 51;
    # NVL 1,671 / 835 sparse, FP32 60. Any other H100 name ("H100 80GB HBM3") is the SXM part.
    (r"\bH100 NVL\b", GpuPeak(835.5, 835.5, 417.5, 60.0)),
    (r"\bH100 PCIe\b", GpuPeak(756.5, 756.5, 378.0, 51.0)),
    (r"\bH100\b", GpuPeak(989.5, 989.5, 494.5, 67.0)),
    # A100 datasheet (40 and 80 GB, SXM and PCIe alike): BF16/FP16 312, TF32 156 dense; FP32 19.5.
    (r"\bA100\b", GpuPeak(312.0, 312.0, 156.0, 19.5)),
    # A30 datasheet: BF16/FP16 165, TF32 82 dense; FP32 10.3.
    (r"\bA30\b", GpuPeak(165.0, 165.0, 82.0, 10.3)),
    # L40S datasheet: BF16/FP16 362.05, TF32 183 dense; FP32 91.6.
    (r"\bL40S\b", GpuPeak(362.05, 362.05, 183.0, 91.6)),
    # L40 datasheet: BF16/FP16 181.05, TF32 90.5 dense; FP32 90.5.
    (r"\bL40\b", GpuPeak(181.05, 181.05, 90.5, 90.5)),
    # L4 datasheet: BF16/FP16 242 and TF32 120 sparse; FP32 30.3.
    (r"\bL4\b", GpuPeak(121.0, 121.0, 60.0, 30.3)),
    # A40 datasheet: BF16/FP16 149.7, TF32 74.8 dense; FP32 37.4.
    (r"\bA40\b", GpuPeak(149.7, 149.7, 74.8, 37.4)),
    # A10 datasheet: BF16/FP16 125, TF32 62.5 dense; FP32 31.2. NVIDIA publishes no datasheet for
    # AWS's A10G, a variant of the A10; we use the A10's figures (set trainer.peak_tflops to override).
    (r"\bA10G?\b", GpuPeak(125.0, 125.0, 62.5, 31.2)),
    # GeForce: the Ada (RTX 4090) and GA102 (RTX 3090) whitepapers' FP16/BF16 tensor rates *with FP32
    # accumulate*, which PyTorch's GEMMs use; GeForce runs it at half the FP16-accumulate rate.
    (r"\bRTX 4090\b", GpuPeak(165.2, 165.2, 82.6, 82.6)),
    (r"\bRTX 3090\b(?! Ti)", GpuPeak(71.0, 71.0, 35.6, 35.6)),
    # V100 datasheet: tensor (FP16) 125 SXM2, 112 PCIe, 130 V100S; FP32 15.7 / 14 / 16.4. No BF16 or TF32.
    (r"\bV100S\b", GpuPeak(None, 130.0, None, 16.4)),
    (r"\bV100-PCIE\b", GpuPeak(None, 112.0, None, 14.0)),
    (r"\bV100\b", GpuPeak(None, 125.0, None, 15.7)),
    # T4 datasheet: FP16 tensor 65; FP32 8.1. No BF16 or TF32.
    (r"\bT4\b", GpuPeak(None, 65.0, None, 8.1)),
]


def lookup_peak_tflops(device_name: str, matmul_dtype: DType, tf32: bool = False) -> float | None:
    """The dense peak TFLOP/s of a GPU by its name, for the dtype its matmuls run in.

    Args:
        device_name: as ``torch.cuda.get_device_name`` gives it, e.g. "NVIDIA A100-SXM4-80GB".
        matmul_dtype: what the matmuls run in (``matmul_dtype``).
        tf32: fp32 matmuls run on TF32 tensor cores (``trainer.tf32``, ``tf32_matmuls``).

    Returns:
        The peak, or None for an unknown GPU, a MIG slice (a fraction of the GPU), or a precision
        the GPU has no tensor cores for (bf16 on V100/T4).
    """
    if "MIG" in device_name:
        return None
    for pattern, peak in GPU_PEAKS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            if matmul_dtype == DType.fp32:
                return peak.tf32 if tf32 else peak.fp32
            return peak.bf16 if matmul_dtype == DType.bf16 else peak.fp16
    return None


def matmul_dtype(precision: DType, weights: DType) -> DType:
    """The dtype the model's matmuls run in: the autocast dtype when there is one, else the weights' own
    (``model.dtype=bf16`` with ``trainer.precision=fp32`` multiplies in bf16, at the bf16 peak).

    Args:
        precision: the resolved ``trainer.precision``.
        weights: ``model.dtype``.
    """
    return precision if precision != DType.fp32 else weights


def tf32_matmuls() -> bool:
    """Whether CUDA fp32 matmuls run on TF32 tensor cores now (``trainer.tf32``, or anyone's setting)."""
    matmul = torch.backends.cuda.matmul
    # torch 2.9 added fp32_precision; reading the legacy flag after the new API was used raises ("mix of the legacy
    # and new APIs"), while fp32_precision reflects either API's setting.
    return matmul.fp32_precision == "tf32" if hasattr(matmul, "fp32_precision") else bool(matmul.allow_tf32)


def peak_tflops(device: torch.device, dtype: DType, override: float | None) -> float | None:
    """The device's dense peak TFLOP/s for ``mfu``: ``trainer.peak_tflops`` if set, else looked up by GPU name.

    Args:
        device: this rank's device.
        dtype: what the matmuls run in (``matmul_dtype``).
        override: ``trainer.peak_tflops``.

    Returns:
        The peak, or None on CPU or an unknown GPU (then ``mfu`` is not logged).
    """
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    return lookup_peak_tflops(torch.cuda.get_device_name(device), dtype, tf32_matmuls())
