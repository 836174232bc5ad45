"""Liger's fused kernels (``model.liger_kernel=true``), and transformers' own classes back where Liger's cannot run.

``apply_liger_kernel`` patches the model family's transformers modeling module with Liger's kernels for the whole
process, before the model is built. Liger's Triton kernels need CUDA tensors, and rank 0's save check builds and runs
its models on the host (``evaluation.peft_check``, ``evaluation.full_check``); so, before the patch,
``keep_originals`` records that modeling module's attributes and those of every class it defines as transformers
defined them, and inside ``unpatched()`` they are put back, Liger's restored when it ends. Rank 0 runs nothing else
meanwhile: the training model does not run during the check (a GPU run's check mirrors it on the host).

What it covers: the patches that replace attributes of the family's own modeling module or of its classes, which is
what Liger does for the causal LMs it supports (Llama, Qwen2, Mistral, Gemma, Phi3, ...: the RMSNorm, MLP and rotary
classes and functions, a class's ``forward``). What it does not: a patch that writes anywhere else. Liger's mllama
patch with ``layer_norm`` (ddptrain asks for it) sets ``modeling_mllama.nn.LayerNorm``, which is ``torch.nn.LayerNorm``
itself, for every model in the process; the patches of vision-language families (llava, mllama, qwen2_vl, gemma3,
...) reach their vision tower's or language model's modules; a ``cross_entropy`` patch sets
``torch.nn.functional.cross_entropy`` (ddptrain leaves it off). Those stay Liger's inside ``unpatched()``.

It lives here, beside ``apply_liger_kernel``, because recording must happen at the patch: the model side calls it, the
save check only asks for the originals back.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AutoConfig

from ddptrain.config import ModelConfig

# What ddptrain asks of Liger; each family's patch function takes the subset it knows (Gemma has
# geglu where Llama and Qwen have swiglu). The loss stays ddptrain's (LM head on target positions
# only), so Liger's cross-entropy patches stay off.
LIGER_KERNELS = {
    "rope": True,
    "rms_norm": True,
    "swiglu": True,
    "geglu": True,
    "layer_norm": True,
    "cross_entropy": False,
    "fused_linear_cross_entropy": False,
}


def apply_liger_kernel(cfg: ModelConfig, device: torch.device) -> None:
    """Patch the model family's transformers classes with Liger's fused kernels (before the model is built), its
    modeling module recorded first (``keep_originals``: what the save check gets back, and what it does not).

    Raises:
        RuntimeError: no CUDA device, liger-kernel not installed (any other import error is shown
            as it is), or an unsupported model family.
    """
    if device.type != "cuda":
        raise RuntimeError("model.liger_kernel=true needs a CUDA device: set model.liger_kernel=false on CPU.")
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ModuleNotFoundError as err:
        if err.name != "liger_kernel":
            raise  # liger-kernel is there but one of its own imports failed: that error says why
        raise RuntimeError(
            "model.liger_kernel=true but liger-kernel is not installed: pip install 'ddptrain[liger]'."
        ) from None
    config = AutoConfig.from_pretrained(cfg.config_path or cfg.name_or_path)
    model_type = config.model_type
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise RuntimeError(
            f"liger-kernel has no kernels for model type '{model_type}' (model.name_or_path={cfg.name_or_path}): "
            "set model.liger_kernel=false."
        )
    patch = MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]
    keep_originals(modeling_module(config))  # the save check builds its host models with transformers' own classes
    accepted = inspect.signature(patch).parameters
    patch(**{name: value for name, value in LIGER_KERNELS.items() if name in accepted})


# ----------------------------------------------------------------------------- transformers' own classes

_ORIGINALS: dict[str, dict[Any, dict[str, Any]]] = {}
"""Per modeling module (by name): the attributes of the module and of each class it defines, as transformers defined
them (recorded before anything patched them)."""
_MISSING = object()


def modeling_module(config: Any) -> types.ModuleType | None:
    """The transformers module that defines the causal LM of ``config``'s model family (imported if need be): the one
    ``AutoModelForCausalLM`` builds it from, else ``transformers.models.<type>.modeling_<type>``; None if neither."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return sys.modules[MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__module__]
    except KeyError:  # a family AutoModelForCausalLM does not build (a vision-language model)
        name = config.model_type.replace("-", "_")
        with contextlib.suppress(ImportError):
            return importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    return None


def keep_originals(module: types.ModuleType | None) -> None:
    """Record ``module``'s attributes and those of the classes it defines, once: call it before they are patched (a
    later call, after a patch, keeps the first record). None: nothing to record. Only this module: what a patch
    writes elsewhere (``torch.nn``, another family's module) is not recorded, and stays patched in ``unpatched()``."""
    if module is None or module.__name__ in _ORIGINALS:
        return
    owners: dict[Any, dict[str, Any]] = {module: dict(vars(module))}
    for value in vars(module).values():
        if isinstance(value, type) and value.__module__ == module.__name__:
            owners[value] = dict(vars(value))
    _ORIGINALS[module.__name__] = owners


def _put(owners: dict[Any, dict[str, Any]], replaced: dict[Any, dict[str, Any]]) -> None:
    """Give each owner (a module, a class) the attributes listed for it where it holds others; what they held goes
    into ``replaced`` as the call goes (so that a failure half-way can still be undone)."""
    for owner, attrs in owners.items():
        for name, value in attrs.items():
            current = vars(owner).get(name, _MISSING)
            if current is value:
                continue
            replaced.setdefault(owner, {})[name] = current
            if value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


@contextlib.contextmanager
def unpatched() -> Iterator[None]:
    """The modeling modules ``keep_originals`` recorded, and their classes, as transformers defined them for the body;
    what they held before (Liger's kernels) is put back when it ends, whatever happened in it."""
    replaced: dict[Any, dict[str, Any]] = {}
    try:
        for owners in _ORIGINALS.values():
            _put(owners, replaced)
        yield
    finally:
        _put(replaced, {})
