"""Where a model's starting weights come from when ``from_pretrained`` does not load them whole.

- ``lora_starts``: every LoRA weight's start, drawn from ``trainer.seed`` alone (as peft draws it: A Kaiming-uniform,
  B zeros), so a run starts from the same adapters whatever drew random numbers before, and a sharded model built
  on the meta device starts where a replica does.
- ``materialize``: a model FSDP2 shards (``parallel.strategy=fsdp2``) with ``model.init=pretrained`` is built on the
  meta device (``parallel.load_device``): no weight exists until it is sharded. Then each rank allocates its shards
  and reads its rows of each pretrained tensor from the safetensors files (``PretrainedRows``: a slice read, not
  the whole tensor), and its rows of each LoRA start. No rank holds the whole model, on the device or the host.
  Files that transformers must convert as it loads them (``why_not_by_rows``) load whole on each rank's host.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from ddptrain import parallel
from ddptrain.config import RunConfig
from ddptrain.model.precision import TORCH_DTYPES

LORA_WEIGHTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


def lora_starts(model: nn.Module, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The start of every LoRA weight of ``model`` (a peft model; its parameters may be on the meta device), as
    ``(parameter name, tensor)`` in parameter order, each whole, fp32 on the host, drawn one at a time from a
    generator seeded with ``seed``, as peft initialises them (``lora_A`` Kaiming-uniform with a=sqrt(5), ``lora_B``
    zeros; for an embedding the other way round, B normal)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        kind = next((k for k in LORA_WEIGHTS if f".{k}." in name), None)
        if kind is None:
            continue
        start = torch.zeros(param.shape)
        if kind == "lora_A":
            nn.init.kaiming_uniform_(start, a=math.sqrt(5), generator=generator)
        elif kind == "lora_embedding_B":
            nn.init.normal_(start, generator=generator)
        yield name, start


def start_lora(model: nn.Module, seed: int) -> None:
    """Set every LoRA weight of ``model`` to its ``lora_starts`` value. On the meta device nothing is drawn (a plan,
    or an FSDP2 run, whose ``materialize`` draws them once the model is sharded)."""
    params = dict(model.named_parameters())
    if all(params[name].is_meta for name in params if any(f".{k}." in name for k in LORA_WEIGHTS)):
        return
    with torch.no_grad():
        for name, start in lora_starts(model, seed):
            params[name].copy_(start)


class PretrainedRows:
    """Rows of the tensors of a pretrained checkpoint (``model.name_or_path``: a folder or a Hub id in the cache),
    read from its safetensors files a slice at a time: ``rows(key, start, stop)`` is ``tensor[start:stop]``.
    ``find`` gives None for a checkpoint without safetensors files (only ``pytorch_model.bin``)."""

    def __init__(self, name_or_path: str, files: dict[str, Path]):
        self.name, self.files = name_or_path, files

    @classmethod
    def find(cls, name_or_path: str) -> PretrainedRows | None:
        from safetensors import safe_open
        from transformers.utils import cached_file

        found = {"_raise_exceptions_for_missing_entries": False}
        index = cached_file(name_or_path, "model.safetensors.index.json", **found)
        if index is not None:
            weight_map = json.loads(Path(index).read_text())["weight_map"]
            paths = {name: cached_file(name_or_path, name) for name in set(weight_map.values())}
            return cls(name_or_path, {key: Path(paths[name]) for key, name in weight_map.items()})
        single = cached_file(name_or_path, "model.safetensors", **found)
        if single is None:
            return None
        with safe_open(single, framework="pt") as f:
            return cls(name_or_path, dict.fromkeys(f.keys(), Path(single)))

    def shapes(self) -> dict[str, list[int]]:
        """Every tensor's shape, from the files' headers (no tensor is read)."""
        from safetensors import safe_open

        shapes = {}
        for path in set(self.files.values()):
            with safe_open(path, framework="pt") as f:
                shapes |= {key: f.get_slice(key).get_shape() for key in f.keys()}  # noqa: SIM118 (not a dict)
        return shapes

    def __call__(self, key: str, start: int, stop: int) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.files[key], framework="pt") as f:
            return f.get_slice(key)[start:stop]


def why_not_by_rows(base: nn.Module, name_or_path: str) -> str | None:
    """Why the base model ``base`` (built from ``name_or_path``'s config, on the meta device) cannot be filled from
    ``name_or_path``'s files row by row, or None when it can: every parameter is there under its own name, with its
    shape. transformers converts some checkpoints as it loads them (older key names, fused experts): those, and a
    checkpoint without safetensors files, load through ``from_pretrained`` instead."""
    rows = PretrainedRows.find(name_or_path)
    if rows is None:
        return "it has no safetensors files"
    shapes = rows.shapes()
    for name, param in base.named_parameters():
        if shapes.get(name) != list(param.shape):
            held = "no such tensor" if name not in shapes else f"shape {shapes[name]}"
            return f"the model's {name} has shape {list(param.shape)}, its files {held}"
    return None


def checkpoint_key(name: str) -> str:
    """The checkpoint's key of a base weight, from its name in the (peft) model: ``base_model.model.`` and peft's
    ``.base_layer`` left out."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def materialize(loss_module: nn.Module, cfg: RunConfig, device: torch.device) -> None:
    """Give a model built on the meta device and sharded (``parallel.shard_model``) its weights: each rank
    allocates its shards on ``device`` (on the host with ``parallel.cpu_offload``, where FSDP2 keeps them) and fills
    them with its rows of the pretrained weights of ``model.name_or_path`` (``why_not_by_rows`` found every one) and
    of the LoRA starts (``trainer.seed``, drawn one tensor at a time). Every rank reads the same files; a model not
    built on the meta device is left as it is."""
    if not any(p.is_meta for p in loss_module.parameters()):
        return
    model = loss_module.model  # the (peft) causal LM: the names its checkpoint and its LoRA starts use
    starts = lora_starts(model, cfg.trainer.seed)  # in parameter order, as ``parallel.materialize`` asks for them
    pretrained, dtype = PretrainedRows.find(cfg.model.name_or_path), TORCH_DTYPES[cfg.model.dtype]
    assert pretrained is not None  # build_model built on the meta device only where the files hold every row

    def rows(name: str, start: int, stop: int) -> torch.Tensor:
        name = name.removeprefix("model.")  # the loss module's own name for the causal LM
        if any(f".{kind}." in name for kind in LORA_WEIGHTS):
            drawn, start_values = next(starts)
            assert drawn == name, (drawn, name)
            return start_values[start:stop]
        # In model.dtype, as from_pretrained loads it: fp32 masters of a bf16 model start from its bf16 values.
        return pretrained(checkpoint_key(name), start, stop).to(dtype)

    parallel.materialize(loss_module, torch.device("cpu") if cfg.parallel.cpu_offload else device, rows)
