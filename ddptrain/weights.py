"""Where a model's starting weights come from when ``from_pretrained`` does not load them whole.

- ``lora_starts``: every LoRA weight's start, drawn from ``trainer.seed`` alone (as peft draws it: A Kaiming-uniform,
  B zeros), so a run starts from the same adapters whatever drew random numbers before, and a sharded model built
  on the meta device starts where a replica does.
- ``materialize``: a model FSDP2 shards (``parallel.strategy=fsdp2``) with ``model.init=pretrained`` is built on the
  meta device (``parallel.load_device``): no weight exists until it is sharded. Then each rank allocates its shards
  and reads its rows of each pretrained tensor from the safetensors files (``PretrainedRows``: a slice read, not
  the whole tensor), and its rows of each LoRA start. No rank ever holds the whole model, on the device or the host.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from ddptrain import parallel
from ddptrain.config import ModelConfig
from ddptrain.precision import TORCH_DTYPES

LORA_WEIGHTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


def lora_starts(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """The start of every LoRA weight of ``model`` (a peft model; its parameters may be on the meta device), by
    parameter name, whole, fp32 on the host: drawn in parameter order from a generator seeded with ``seed``, as peft
    initialises them (``lora_A`` Kaiming-uniform with a=sqrt(5), ``lora_B`` zeros; for an embedding the other way
    round, B normal)."""
    generator = torch.Generator().manual_seed(seed)
    starts = {}
    for name, param in model.named_parameters():
        kind = next((k for k in LORA_WEIGHTS if f".{k}." in name), None)
        if kind is None:
            continue
        start = torch.zeros(param.shape)
        if kind == "lora_A":
            nn.init.kaiming_uniform_(start, a=math.sqrt(5), generator=generator)
        elif kind == "lora_embedding_B":
            nn.init.normal_(start, generator=generator)
        starts[name] = start
    return starts


def start_lora(model: nn.Module, seed: int) -> None:
    """Set every LoRA weight of ``model`` to its ``lora_starts`` value (on the meta device: left for
    ``materialize``)."""
    starts = lora_starts(model, seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in starts and not param.is_meta:
                param.copy_(starts[name])


class PretrainedRows:
    """Rows of the tensors of a pretrained checkpoint (``model.name_or_path``: a folder or a Hub id in the cache),
    read from its safetensors files a slice at a time: ``rows(key, start, stop)`` is ``tensor[start:stop]``.

    Raises:
        ValueError: the checkpoint has no safetensors files (only ``pytorch_model.bin``), naming the fix.
    """

    def __init__(self, name_or_path: str):
        from transformers.utils import cached_file

        self.name = name_or_path
        found = {"_raise_exceptions_for_missing_entries": False}
        index = cached_file(name_or_path, "model.safetensors.index.json", **found)
        if index is not None:
            weight_map = json.loads(Path(index).read_text())["weight_map"]
            files = {name: cached_file(name_or_path, name) for name in set(weight_map.values())}
            self.files = {key: Path(files[name]) for key, name in weight_map.items()}
            return
        single = cached_file(name_or_path, "model.safetensors", **found)
        if single is None:
            raise ValueError(
                f"parallel.strategy=fsdp2 reads each rank's share of model.name_or_path={name_or_path} from its "
                "safetensors files, and it has none (a pytorch_model.bin checkpoint?): save it once with "
                "save_pretrained(..., safe_serialization=True), or train it with parallel.strategy=ddp."
            )
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            self.files = dict.fromkeys(f.keys(), Path(single))

    def __call__(self, key: str, start: int, stop: int) -> torch.Tensor:
        from safetensors import safe_open

        if key not in self.files:
            raise ValueError(
                f"model.name_or_path={self.name} holds no tensor {key!r}, which the model built from its config "
                "has: its weights do not match its config.json. Point model.name_or_path at a checkpoint saved by "
                "transformers, or train it with parallel.strategy=ddp (which loads it through from_pretrained)."
            )
        with safe_open(self.files[key], framework="pt") as f:
            part = f.get_slice(key)
            return part[start:stop] if part.get_shape() else part[:]


def checkpoint_key(name: str) -> str:
    """The checkpoint's key of a base weight, from its name in the (peft) model: ``base_model.model.`` and peft's
    ``.base_layer`` left out."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def materialize(loss_module: nn.Module, cfg: ModelConfig, seed: int, device: torch.device) -> None:
    """Give a model built on the meta device and sharded (``parallel.shard_model``) its weights: each rank
    allocates its shards on ``device`` and fills them with its rows of the pretrained weights and of the LoRA starts.
    Every rank reads the same files; a model that was not built on the meta device is left as it is."""
    if not any(p.is_meta for p in loss_module.parameters()):
        return
    model = loss_module.model  # the (peft) causal LM: the names its checkpoint and its LoRA starts use
    starts = lora_starts(model, seed) if cfg.lora else {}
    pretrained, dtype = PretrainedRows(cfg.name_or_path), TORCH_DTYPES[cfg.dtype]

    def rows(name: str, start: int, stop: int) -> torch.Tensor:
        name = name.removeprefix("model.")  # the loss module's own name for the causal LM
        if name in starts:
            return starts[name][start:stop]
        # In model.dtype, as from_pretrained loads it: fp32 masters of a bf16 model start from its bf16 values.
        return pretrained(checkpoint_key(name), start, stop).to(dtype)

    parallel.materialize(loss_module, device, rows)
