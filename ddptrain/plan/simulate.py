"""One micro-step of the run's model simulated on fake tensors: what it keeps for backward and its peak.

The model is built from its config on the meta device (no weights, no memory), with the run's LoRA, gradient
checkpointing, attention kernel and loss head, and its parameters turned into fake tensors (``FakeTensorMode``:
shapes, dtypes and strides, no data). A forward pass and a backward pass then run for a micro-batch of a given shape
under the run's autocast, through the same transformers, peft and ddptrain code a real step runs. Nothing is written
per architecture: any causal LM in transformers plans, and what each op saves is whatever that op saves.

Two figures come out, both counted on the simulated tensors:
- **saved**: the bytes the forward pass keeps for backward (``torch.autograd.graph.saved_tensors_hooks``, each
  storage once, parameters excluded): with gradient checkpointing, the checkpointed layers' inputs;
- **peak**: the most bytes alive at once during forward and backward (every tensor an op creates, freed when the
  last tensor on its storage is), beyond the parameters and the gradients' own buffers (DDP's buckets): the saved
  activations plus the transients on top of them (the LM head's logits chunk, a layer recomputed under
  checkpointing, the gradients flowing back through a layer).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM, PretrainedConfig

from ddptrain.config import Attention, DType, ModelConfig, Objective, ObjectiveConfig, Reference
from ddptrain.model import CausalLMLoss, apply_gradient_checkpointing, apply_lora
from ddptrain.model.precision import TORCH_DTYPES
from ddptrain.model.preference import PreferenceLoss
from ddptrain.plan.flash import PLANNED_FLASH


@dataclass(frozen=True)
class BatchShape:
    """A collated micro-batch as the model sees it (``data.Collator``)."""

    rows: int  # 1 when packed
    width: int  # padded length of every row (packed: all samples' tokens)
    targets: int  # positions whose next label is trained on: the LM head's rows
    padded: bool = True  # some row is shorter than the width: transformers builds a padding mask
    packed: bool = False  # samples concatenated, positions restarting: a block-diagonal mask
    pairs: int = 0  # objective=dpo: the preference pairs, whose chosen then rejected sequences are the rows

    @property
    def tokens(self) -> int:
        return self.rows * self.width


@dataclass(frozen=True)
class StepMemory:
    """Bytes of one simulated micro-step (see the module's docstring)."""

    saved: int  # kept for backward at the end of the forward pass
    peak: int  # alive at once, at the step's fullest moment (the LM head's logits chunk included)


class FakeModel:
    """The run's model on fake tensors, stepped for any batch shape: two copies cut to the first 2 and 3 decoder
    layers are simulated and every figure is carried on linearly to the model's own depth (decoder layers repeat one
    structure; simulating 28 layers of a 7B model takes ten times as long and gives the same bytes). ``compiled``: the
    run compiles the model (trainer.compile), under which transformers builds the attention mask whatever the
    padding (``_masks_as_the_run_builds_them``). ``objective``: objective=dpo steps DPO's loss module, whose
    adapter-off reference forward (objective.reference=adapter_off) runs between the policy's forward and backward."""

    def __init__(
        self,
        config: PretrainedConfig,
        cfg: ModelConfig,
        precision: DType,
        compiled: bool = False,
        objective: ObjectiveConfig | None = None,
    ):
        self.layers = config.num_hidden_layers
        depth = functools.partial(_FakeDepth, cfg=cfg, precision=precision, compiled=compiled, objective=objective)
        self.cut = [depth(_cut_to(config, n)) for n in (2, 3)] if self.layers > 3 else []
        self.whole = None if self.cut else depth(config)

    def _extend(self, measure: Callable[[_FakeDepth], int]) -> int:
        if self.whole is not None:
            return measure(self.whole)
        two, three = (measure(model) for model in self.cut)
        return two + (self.layers - 2) * (three - two)

    def carried(self, measure: Callable[[nn.Module], int]) -> int:
        """``measure`` of the run's module (``CausalLMLoss``) at each simulated depth, carried on to the model's own
        depth: for a measure of the whole model its value at full depth, for one of a unit (a layer, the root) that
        unit's."""
        return self._extend(lambda m: measure(m.module))

    def parameter_bytes(self) -> dict[str, int]:
        """Bytes of the parameters by dtype name ("bfloat16", "float32")."""
        names = {str(p.dtype).removeprefix("torch.") for p in (self.whole or self.cut[0]).module.parameters()}
        return {name: self._extend(lambda m, n=name: m.parameter_bytes().get(n, 0)) for name in sorted(names)}

    def trainable_parameters(self) -> tuple[int, int]:
        """(count, bytes) of the trainable parameters."""
        return self._extend(lambda m: m.trainable_parameters()[0]), self._extend(lambda m: m.trainable_parameters()[1])

    def step(self, shape: BatchShape) -> StepMemory:
        """One training micro-step of ``shape`` (see the module's docstring)."""
        steps = {}

        def measure(m: _FakeDepth, field: str) -> int:
            if id(m) not in steps:
                steps[id(m)] = m.step(shape)
            return getattr(steps[id(m)], field)

        return StepMemory(
            saved=self._extend(lambda m: measure(m, "saved")),
            peak=self._extend(lambda m: measure(m, "peak")),
        )

    def forward_peak(self, shape: BatchShape) -> int:
        """The most bytes alive at once in a forward pass without gradients (evaluation)."""
        return self._extend(lambda m: m.forward_peak(shape))


def _cut_to(config: PretrainedConfig, layers: int) -> PretrainedConfig:
    """A copy of ``config`` with its first ``layers`` decoder layers (and per-layer settings cut to match)."""
    cut = copy.deepcopy(config)
    cut.num_hidden_layers = layers
    if isinstance(getattr(cut, "layer_types", None), list):
        cut.layer_types = cut.layer_types[:layers]
    return cut


class _FakeDepth:
    """The run's loss module (``CausalLMLoss``) on fake tensors at one depth, stepped for any batch shape."""

    def __init__(
        self,
        config: PretrainedConfig,
        cfg: ModelConfig,
        precision: DType,
        compiled: bool = False,
        objective: ObjectiveConfig | None = None,
    ):
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.compiled = compiled
        self.precision = precision
        self.module = _fake_loss_module(config, cfg, self.mode, objective)
        # A precomputed reference comes with the batch: no reference forward in the step.
        self.reference_in_batch = objective is not None and objective.reference == Reference.precomputed
        self.trainable = [p for p in self.module.parameters() if p.requires_grad]
        self._parameter_storages = {_storage_key(p) for p in self.module.parameters()}

    def step(self, shape: BatchShape) -> StepMemory:
        """Forward and backward of one micro-batch of ``shape``, counted (see the module's docstring)."""
        with self.mode, _masks_as_the_run_builds_them(shape, self.compiled):
            batch = _fake_batch(shape, self.reference_in_batch)
            # The gradients' buffers exist before the step (DDP's buckets): counted with the parameters, not here.
            for p in self.trainable:
                p.grad = torch.zeros_like(p)
            saved: dict[int, int] = {}
            live = LiveBytes(ignore=self._parameter_storages | {_storage_key(p.grad) for p in self.trainable})
            with live, self._autocast(), _saved_bytes(saved, self._parameter_storages):
                loss, _ = self.module(**batch)
            kept = sum(saved.values())
            with live:
                loss.backward()
            for p in self.trainable:
                p.grad = None
        return StepMemory(saved=kept, peak=live.peak)

    def forward_peak(self, shape: BatchShape) -> int:
        """The most bytes alive at once in a forward pass without gradients (evaluation)."""
        with self.mode, torch.no_grad(), _masks_as_the_run_builds_them(shape, self.compiled):
            batch = _fake_batch(shape, self.reference_in_batch)
            live = LiveBytes(ignore=self._parameter_storages)
            with live, self._autocast():
                self.module.eval_sums(**batch)
        return live.peak

    def parameter_bytes(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for p in self.module.parameters():
            name = str(p.dtype).removeprefix("torch.")
            found[name] = found.get(name, 0) + p.numel() * p.element_size()
        return found

    def trainable_parameters(self) -> tuple[int, int]:
        return sum(p.numel() for p in self.trainable), sum(p.numel() * p.element_size() for p in self.trainable)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == DType.fp32:
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=TORCH_DTYPES[self.precision])


def _fake_loss_module(
    config: PretrainedConfig, cfg: ModelConfig, mode: FakeTensorMode, objective: ObjectiveConfig | None = None
) -> nn.Module:
    """``model.build_model`` on the meta device, then every parameter and buffer made a fake CPU tensor."""
    attention = Attention(cfg.attn_implementation).value
    if attention == Attention.flash_attention_2:
        attention = PLANNED_FLASH  # flash-attn needs CUDA: what its kernels allocate, no mask (plan/flash.py)
    config.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=TORCH_DTYPES[cfg.dtype], attn_implementation=attention)
    if cfg.lora:
        model = apply_lora(model, cfg, seed=0)  # on the meta device: shapes only, nothing drawn
    if cfg.gradient_checkpointing:
        apply_gradient_checkpointing(model, cfg.gradient_checkpointing_reentrant)
    module = CausalLMLoss(model, cfg.loss_chunk_tokens)
    if objective is not None and objective.name == Objective.dpo:
        module = PreferenceLoss(module, objective)
    module.train()
    with mode:
        # One fake per parameter, shared where the model shares it (an LM head tied to the embedding): the weights
        # are counted once, as the real model holds them. The original is kept beside its fake, so that its id is
        # not reused by another parameter while the modules are walked.
        fakes: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
        for owner in module.modules():
            for name, p in owner._parameters.items():
                if p is not None:
                    if id(p) not in fakes:
                        fake = nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
                        fakes[id(p)] = (p, fake)
                    owner._parameters[name] = fakes[id(p)][1]
            for name, b in owner._buffers.items():
                if b is not None:
                    owner._buffers[name] = torch.empty_like(b, device="cpu")
    return module


@contextlib.contextmanager
def _masks_as_the_run_builds_them(shape: BatchShape, compiled: bool) -> Iterator[None]:
    """Whether the attention kernel gets a materialised mask, as the real step of ``shape`` decides it.

    For SDPA, transformers skips the (rows x 1 x width x width) mask and lets the kernel apply causality itself when
    no token is padded (``masking_utils._ignore_causal_mask_sdpa``), but it never skips for a fake tensor, which it
    takes for a graph being traced: simulated as it is, an unpadded batch would keep that mask in every layer (at
    10 x 2,048 tokens, 168 MB a layer that the real step never allocates). Here the fake step takes the decision the
    real one takes: a padded batch gets its mask (the collator's mask has zeros), an unpadded one the same checks
    transformers makes on real tensors, with no padding. Packed rows get a block mask either way (elsewhere). A
    compiled model (``compiled``) gets one always: under dynamo transformers takes the collator's mask for traced
    and builds the 4D mask (torch before 2.14, as the comment in its ``_ignore_causal_mask_sdpa`` says)."""
    try:
        from transformers import masking_utils

        decide = masking_utils._ignore_causal_mask_sdpa
    except (ImportError, AttributeError):  # another transformers: simulate as it is
        yield
        return

    def as_the_run(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        if shape.padded or shape.packed or (compiled and _torch_before((2, 14))):
            return False
        return decide(
            None, q_length, kv_length, 0, kv_offset if isinstance(kv_offset, int) else 0, local_attention_size
        )

    masking_utils._ignore_causal_mask_sdpa = as_the_run
    try:
        yield
    finally:
        masking_utils._ignore_causal_mask_sdpa = decide


def _torch_before(version: tuple[int, int]) -> bool:
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) < version


def _fake_batch(shape: BatchShape, reference_in_batch: bool = False) -> dict[str, torch.Tensor]:
    """What the collator hands the model for a micro-batch of ``shape``, as fake tensors (call inside the mode);
    ``reference_in_batch``: pairs carry their precomputed reference log-probabilities."""
    size = (shape.rows, shape.width)
    batch = {
        "input_ids": torch.zeros(size, dtype=torch.long),
        "labels": torch.zeros(size, dtype=torch.long),
        "target_index": torch.zeros(shape.targets, dtype=torch.long),
    }
    if shape.pairs and reference_in_batch:
        batch["reference_logps"] = torch.zeros(shape.rows)
    if shape.packed:
        batch["position_ids"] = torch.zeros(size, dtype=torch.long)
    else:  # the collator's mask, padded or not (whether it is materialised: _masks_as_the_run_builds_them)
        batch["attention_mask"] = torch.ones(size, dtype=torch.long)
    return batch


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@contextlib.contextmanager
def _saved_bytes(saved: dict[int, int], ignore: set[int]) -> Iterator[None]:
    """Record in ``saved`` every storage autograd keeps for backward (by storage, so views count once)."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in ignore:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages alive while it is active: every op's outputs are counted until the last tensor that
    views their storage is freed; ``peak`` is the most at any time. Storages in ``ignore`` are not counted."""

    def __init__(self, ignore: set[int]):
        super().__init__()
        self.ignore = ignore
        self.now = self.peak = 0
        self._views: dict[int, int] = {}  # storage -> tensors alive on it
        self._sizes: dict[int, int] = {}
        self._tracked: dict[int, weakref.finalize] = {}  # id(tensor) -> its finalizer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t) not in self._tracked:
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key in self.ignore:
            return
        if key not in self._views:
            self._views[key], self._sizes[key] = 0, t.untyped_storage().nbytes()
            self.now += self._sizes[key]
            self.peak = max(self.peak, self.now)
        self._views[key] += 1
        self._tracked[id(t)] = weakref.finalize(t, self._release, id(t), key)

    def _release(self, tensor_id: int, key: int) -> None:
        self._tracked.pop(tensor_id, None)
        self._views[key] -= 1
        if self._views[key] == 0:
            self.now -= self._sizes.pop(key)
            del self._views[key]
