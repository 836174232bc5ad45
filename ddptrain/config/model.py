"""The ``model`` group's schema (``conf/model/``): which model, its dtype and attention, LoRA, gradient
checkpointing and the chunked head loss, and their checks, including those that depend on the trainer's device and
precision and on DDP (``trainer.compile`` with checkpointing). ``resolve_precision`` says which autocast dtype
``trainer.precision`` becomes on a device: it returns a ``DType``, this group's enum.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Optional

from omegaconf import MISSING

import ddptrain.config.checks as checks
from ddptrain.config.checks import _looks_local, _positive
from ddptrain.config.parallel import ParallelConfig, Strategy
from ddptrain.config.trainer import Device, Precision, TrainerConfig


class ModelInit(str, Enum):
    pretrained = "pretrained"  # from_pretrained(model.name_or_path)
    random = "random"  # from_config(model.config_path): no weights needed


class DType(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Attention(str, Enum):
    sdpa = "sdpa"  # torch scaled_dot_product_attention
    eager = "eager"  # plain matmul + softmax (slow; for checks)
    flash_attention_2 = "flash_attention_2"  # needs the flash-attn package and a GPU


@dataclass
class ModelConfig:
    name_or_path: str = MISSING
    """Hub id or local folder for ``from_pretrained`` (model.init=pretrained)."""
    init: ModelInit = ModelInit.pretrained
    """pretrained: load weights; random: build from model.config_path with random weights."""
    config_path: Optional[str] = None
    """Architecture config (folder or config.json) for model.init=random; null = name_or_path."""
    tokenizer: Optional[str] = None
    """Tokenizer folder or hub id; null = model.name_or_path."""
    dtype: DType = DType.fp32
    """Storage dtype of the frozen base weights (LoRA weights always stay fp32)."""
    attn_implementation: Attention = Attention.sdpa
    """transformers attention kernel. Each keeps packed samples apart through their position_ids.
    flash_attention_2 needs a CUDA device and fp16/bf16 (model.dtype or trainer.precision)."""
    lora: bool = True
    """Train LoRA adapters; false = full fine-tune of every parameter."""
    lora_rank: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: str = "all-linear"
    """peft target_modules: 'all-linear' or a comma-separated list of module names."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (non-reentrant, DDP-safe): less memory, ~20-30% slower."""
    loss_chunk_tokens: int = 512
    """LM head + loss over this many target tokens at a time, gradients formed chunk by chunk:
    peak logits memory is chunk x vocab x 4 bytes instead of all targets'; 0 = plain autograd."""
    gradient_checkpointing_reentrant: bool = False
    """Use torch's older reentrant checkpointing (refused with parallel.find_unused_parameters=true)."""
    liger_kernel: bool = False
    """Liger-Kernel's fused RMSNorm/SwiGLU/RoPE kernels (CUDA only; pip install 'ddptrain[liger]')."""
    device_map: Optional[str] = None
    """Refused under DDP (each rank holds a full replica); kept so the error can say so."""
    base_adapter: Optional[str] = None
    """A LoRA adapter folder (an earlier run's best/ or adapter/) merged into model.name_or_path before this run's own
    adapter: the base this run trains on, and under objective=dpo its reference (DPO after SFT). The run writes that
    merged base to <run>/base once, and its adapters load onto it there. null = model.name_or_path as it is."""


def _check_model(m: ModelConfig, p: ParallelConfig, t: TrainerConfig) -> list[str]:
    problems = _positive({"model.lora_rank": m.lora_rank})
    if m.loss_chunk_tokens < 0:
        problems.append(f"model.loss_chunk_tokens={m.loss_chunk_tokens} must be 0 (off) or a positive count.")
    if m.device_map is not None:
        problems.append(
            f"model.device_map={m.device_map} splits one model over several devices, but under DDP "
            "every rank holds a full replica on its own device: remove model.device_map."
        )
    if m.init == ModelInit.random and m.config_path is None and not _looks_local(m.name_or_path):
        problems.append(
            "model.init=random needs an architecture config: set model.config_path=<folder with config.json>."
        )
    if m.gradient_checkpointing and m.gradient_checkpointing_reentrant and p.find_unused_parameters:
        problems.append(
            "model.gradient_checkpointing_reentrant=true with parallel.find_unused_parameters=true makes DDP "
            'fail with "Expected to mark a variable ready only once": set '
            "model.gradient_checkpointing_reentrant=false (non-reentrant works with DDP and LoRA)."
        )
    if m.liger_kernel and t.device == Device.cpu:
        problems.append(
            "model.liger_kernel=true needs a CUDA device (Liger's kernels are Triton GPU kernels), but "
            "trainer.device=cpu: set model.liger_kernel=false or train on GPUs."
        )
    if m.attn_implementation == Attention.flash_attention_2:
        problems += _check_flash_attention(m, t)
    if not 0.0 <= m.lora_dropout < 1.0:
        problems.append(f"model.lora_dropout={m.lora_dropout} must be in [0, 1).")
    if m.base_adapter is not None:
        problems += _check_base_adapter(m, p)
    return problems + _check_precision(m, t, p) + _check_compile(m, p, t)


def _check_base_adapter(m: ModelConfig, p: ParallelConfig) -> list[str]:
    """model.base_adapter: an adapter folder, trained on model.name_or_path, merged into a replica (not sharded)."""
    config_file = Path(m.base_adapter) / "adapter_config.json"
    if not config_file.is_file():
        return [
            f"model.base_adapter={m.base_adapter} holds no adapter_config.json: name a LoRA adapter folder, e.g. an "
            "SFT run's <run>/best or <run>/adapter."
        ]
    problems = []
    trained_on = json.loads(config_file.read_text()).get("base_model_name_or_path")
    if m.init != ModelInit.pretrained or (trained_on is not None and not _same_model(trained_on, m.name_or_path)):
        base = trained_on or "<the base it was trained on>"
        problems.append(
            f"model.base_adapter={m.base_adapter} was trained on {base}, but this run starts from "
            f"model.name_or_path={m.name_or_path} (model.init={m.init.value}): set model.name_or_path={base} "
            "model.init=pretrained."
        )
    if p.strategy == Strategy.fsdp2:
        problems.append("model.base_adapter is merged into a whole replica: use parallel.strategy=ddp, not fsdp2.")
    return problems


def _same_model(a: str, b: str) -> bool:
    """Two names of one model: the same Hub id, or the same folder."""
    return a == b or (Path(a).is_dir() and Path(b).is_dir() and Path(a).resolve() == Path(b).resolve())


def _check_precision(m: ModelConfig, t: TrainerConfig, p: ParallelConfig) -> list[str]:
    """Weights whose dtype the run cannot train correctly: low-precision trainable weights, fp16 without a scaler.
    Under parallel.strategy=fsdp2 a bf16 model's full fine-tune trains fp32 masters (``parallel.fsdp``)."""
    sharded = p.strategy == Strategy.fsdp2
    if m.dtype == DType.bf16 and not m.lora and sharded:
        return []
    if m.dtype != DType.fp32 and not m.lora:
        # AdamW steps the weights in their own dtype: an update of 1e-5 on a bf16 weight of 0.02 (8 bits of
        # mantissa) rounds to nothing, and GradScaler refuses to unscale fp16 gradients.
        scaler = ", and GradScaler cannot unscale fp16 gradients" if m.dtype == DType.fp16 else ""
        return [
            f"model.dtype={m.dtype.value} with model.lora=false makes the optimizer update {m.dtype.value} weights: "
            f"small updates round to nothing and the model silently stops learning{scaler}. Train fp32 weights under "
            "autocast: model.dtype=fp32 trainer.precision=bf16 (or auto on a bf16 GPU), or keep model.lora=true"
            + (", or parallel.strategy=fsdp2 with model.dtype=bf16 (fp32 masters, sharded)." if not sharded else ".")
        ]
    if m.dtype == DType.fp16 and t.precision != Precision.fp16:
        # Without fp16 autocast there is no GradScaler: backward runs through fp16 activations unscaled, and
        # gradients divided by the token count fall into fp16's subnormal range.
        return [
            f"model.dtype=fp16 needs trainer.precision=fp16 (autocast with a GradScaler), but trainer.precision="
            f"{t.precision.value}: set trainer.precision=fp16, or use model.dtype=bf16 on a GPU that has bf16."
        ]
    return []


# torch.compile of a DDP model with gradient checkpointing fails in DDPOptimizer ("Found a higher order op in the
# graph") before torch 2.6, which fixed it.
COMPILE_CHECKPOINTING_MIN_TORCH = (2, 6)


def _check_compile(m: ModelConfig, p: ParallelConfig, t: TrainerConfig) -> list[str]:
    if not (t.compile and m.gradient_checkpointing and p.nproc_per_node != 1):
        return []
    version = checks.installed_torch_version()
    if version is None or version >= COMPILE_CHECKPOINTING_MIN_TORCH:
        return []
    found = ".".join(map(str, version))
    return [
        f"trainer.compile=true with model.gradient_checkpointing=true under DDP crashes on torch {found} "
        '("DDPOptimizer backend: Found a higher order op in the graph", fixed in torch 2.6): upgrade torch to '
        "2.6 or newer, or set trainer.compile=false, or model.gradient_checkpointing=false."
    ]


def _check_flash_attention(m: ModelConfig, t: TrainerConfig) -> list[str]:
    """flash-attn's kernels take fp16/bf16 tensors on a CUDA device only."""
    problems = []
    if m.dtype == DType.fp32 and t.precision == Precision.fp32:
        problems.append(
            "model.attn_implementation=flash_attention_2 needs fp16/bf16 activations, but model.dtype=fp32 "
            "and trainer.precision=fp32: set trainer.precision=bf16 (or model.dtype=bf16), "
            "or use model.attn_implementation=sdpa."
        )
    if t.device == Device.cpu:
        why = "trainer.device=cpu"
    elif t.device == Device.auto and not checks._cuda_available():
        why = "trainer.device=auto means cpu here (no CUDA device is visible)"
    else:
        return problems
    problems.append(
        f"model.attn_implementation=flash_attention_2 needs a CUDA device, but {why}: "
        "use model.attn_implementation=sdpa on CPU, or train on GPUs."
    )
    return problems


def resolve_precision(precision: Precision, device_type: str, bf16_supported: bool) -> DType:
    """What ``trainer.precision`` means on this device: ``auto`` becomes bf16 on a CUDA device that supports it
    and fp32 elsewhere (CPU autocast gains nothing over fp32 matmuls on most CPUs); explicit values stand.

    Args:
        precision: ``trainer.precision``.
        device_type: this rank's device type ("cuda" or "cpu").
        bf16_supported: whether the device runs bf16 natively (``torch.cuda.is_bf16_supported``).

    Returns:
        The autocast dtype to train with (fp32: no autocast).
    """
    if precision != Precision.auto:
        return DType(precision.value)
    return DType.bf16 if device_type == "cuda" and bf16_supported else DType.fp32
