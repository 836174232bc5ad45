"""The forward pass's numerics: ``trainer.precision`` (the autocast dtype) and ``trainer.tf32``.

``settle_precision`` resolves ``trainer.precision=auto`` on this rank's device once it is known and switches
TF32 for CUDA's fp32 matmuls; ``autocast`` is the context the trainer runs forward passes in. ``TORCH_DTYPES``
maps the config's dtype names to torch's (``model.dtype`` loads weights with it).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace

import torch

from ddptrain.config import DType, Precision, TrainerConfig, resolve_precision

log = logging.getLogger(__name__)

TORCH_DTYPES = {DType.fp32: torch.float32, DType.bf16: torch.bfloat16, DType.fp16: torch.float16}


def autocast(precision: DType, device: torch.device) -> contextlib.AbstractContextManager:
    """The forward pass's mixed precision (``trainer.precision``, resolved): none for fp32."""
    if precision == DType.fp32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=TORCH_DTYPES[precision])


def settle_precision(cfg: TrainerConfig, device: torch.device) -> TrainerConfig:
    """``trainer.precision`` and ``trainer.tf32`` applied to this rank's device, once it is known.

    ``auto`` becomes bf16 on a CUDA device with native bf16 (compute capability 8.0 and up), fp32 elsewhere; the
    returned config holds the choice, so the run log, ``config.yaml`` and the diagnosis all show it. TF32 is
    switched on (or off) for CUDA's fp32 matmuls where the GPU has it; the CPU is left alone.

    Returns:
        ``cfg`` with ``precision`` resolved (never ``auto``).
    """
    chosen = autocast_dtype(cfg, device)
    ampere_or_newer = _ampere_or_newer(device)
    if cfg.precision == Precision.auto:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        what = "bf16 autocast" if chosen == DType.bf16 else "fp32, no autocast (no native bf16)"
        log.info("trainer.precision=auto on %s: %s", name, what)
    if ampere_or_newer:
        use_tf32_matmuls(cfg.tf32)
        log.info("trainer.tf32=%s: fp32 matmuls run in %s", str(cfg.tf32).lower(), "TF32" if cfg.tf32 else "IEEE fp32")
    return replace(cfg, precision=Precision(chosen.value))


def autocast_dtype(cfg: TrainerConfig, device: torch.device) -> DType:
    """What ``trainer.precision`` means on ``device`` (``config.resolve_precision`` with the device's facts)."""
    return resolve_precision(cfg.precision, device.type, bf16_supported=_ampere_or_newer(device))


def sharded_compute_dtype(precision: DType, model_dtype: DType, lora: bool) -> torch.dtype | None:
    """What FSDP2's units gather their weights in (``MixedPrecisionPolicy.param_dtype``): the autocast dtype; for a
    full fine-tune of a bf16 or fp16 model (its masters upcast to fp32) that model's dtype; else None (as stored:
    the same arithmetic as DDP's replica)."""
    if precision != DType.fp32:
        return TORCH_DTYPES[precision]
    return TORCH_DTYPES[model_dtype] if not lora and model_dtype != DType.fp32 else None


def _ampere_or_newer(device: torch.device) -> bool:
    """Compute capability 8.0 and up: native bf16 and TF32 tensor cores."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8


def use_tf32_matmuls(enabled: bool) -> None:
    """CUDA's fp32 matmuls and convolutions on TF32 tensor cores, or in IEEE fp32."""
    # The long-standing flags, not torch 2.9's per-backend ``fp32_precision``: once that is set for CUDA alone,
    # torch.get_float32_matmul_precision() raises ("mix of the legacy and new APIs"), and inductor's autotuning and
    # other libraries call it. Neither touches oneDNN's CPU matmuls, which set_float32_matmul_precision would.
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
