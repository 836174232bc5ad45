"""Tokenizer, base model, LoRA and the loss module that DDP wraps.

``build_model`` returns a ``CausalLMLoss``: the (peft) model plus the loss, in one
``nn.Module``. DDP wraps that module, so the loss is always computed inside DDP's
forward (a loss computed outside the wrapper silently skips gradient sync). The ignore label comes from
the data side (``data/encode.py``); the forward pass's numerics (autocast, TF32) live in ``precision.py``.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from ddptrain.config import ModelConfig, ModelInit, Objective, ObjectiveConfig
from ddptrain.data.encode import IGNORE_INDEX
from ddptrain.model.head_loss import ChunkedHeadLoss, capped, chunked_head_eval_sums, top1_correct
from ddptrain.model.liger import apply_liger_kernel
from ddptrain.model.precision import TORCH_DTYPES
from ddptrain.model.preference import PreferenceLoss
from ddptrain.model.reference import precompute_reference as precompute_reference  # the trainer calls it
from ddptrain.model.weights import start_lora, why_not_by_rows

log = logging.getLogger(__name__)


def build_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer named by model.tokenizer (or model.name_or_path), with a pad token.

    Raises:
        ValueError: the tokenizer has no EOS token (training appends one to every row).
    """
    source = cfg.tokenizer or cfg.name_or_path
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"model.tokenizer={source} has no EOS token: pick a tokenizer with an eos_token.")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_base_model(cfg: ModelConfig, seed: int, device: torch.device | None = None) -> nn.Module:
    """The transformers causal LM: pretrained weights, or random weights from an architecture config.

    Random weights depend only on ``seed`` (and the transformers version), so every rank
    builds the same model, and a test can build it again. They are drawn on the CPU (the
    same numbers whatever the device); pretrained weights load straight onto ``device``, so
    N ranks on one node never hold N copies of the model in host memory.
    """
    dtype = TORCH_DTYPES[cfg.dtype]
    if device is not None and torch.device(device).type == "meta":  # FSDP2: shapes only (``weights.materialize``)
        return _on_meta_device(cfg, dtype)
    if cfg.init == ModelInit.random:
        config = AutoConfig.from_pretrained(cfg.config_path or cfg.name_or_path)
        config.use_cache = False
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=cfg.attn_implementation.value)
    else:
        # model.base_adapter merges on the host, as <run>/base is written (save_random_base): the same numbers.
        on_host = device is None or cfg.base_adapter is not None
        model = AutoModelForCausalLM.from_pretrained(
            cfg.name_or_path,
            dtype=dtype,
            attn_implementation=cfg.attn_implementation.value,
            device_map=None if on_host else {"": str(device)},
        )
        model.config.use_cache = False
    if cfg.base_adapter is None:
        return model
    merged = merge_base_adapter(model, cfg.base_adapter)
    return merged if device is None else merged.to(device)


def merge_base_adapter(model: nn.Module, folder: str) -> nn.Module:
    """``model`` with the LoRA adapter in ``folder`` merged into its weights (model.base_adapter): the model that
    adapter's run trained, now a plain transformers model that a new adapter goes onto."""
    from peft import PeftModel

    merged = PeftModel.from_pretrained(model, folder).merge_and_unload()
    log.info("model: %s merged into the base (model.base_adapter)", folder)
    return merged


def _on_meta_device(cfg: ModelConfig, dtype: torch.dtype) -> nn.Module:
    """The model of ``model.name_or_path``'s config with every parameter on the meta device: no memory, no weights;
    its buffers (rotary frequencies, computed from the config) are real, on the host."""
    from accelerate import init_empty_weights

    config = AutoConfig.from_pretrained(cfg.name_or_path)  # the weights' own, as from_pretrained reads it
    config.use_cache = False
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=cfg.attn_implementation.value)
    model.tie_weights()  # init_empty_weights gives a tied head a parameter of its own: one again, as loaded
    return model


def apply_lora(model: nn.Module, cfg: ModelConfig, seed: int) -> nn.Module:
    """Freeze the base model and add LoRA adapters (trainable, kept in fp32), which start from ``seed``
    (``weights.lora_starts``)."""
    from peft import LoraConfig, get_peft_model

    targets: str | list[str] = cfg.lora_target_modules
    if targets != "all-linear":
        targets = [name.strip() for name in targets.split(",") if name.strip()]
    lora = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():
        # PeftModel.__init__ (peft 0.21) reads the base model's `is_gradient_checkpointing`, which
        # transformers 5.x deprecates for `is_activation_checkpointing`: peft's access, not ours to change.
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        # autocast_adapter_dtype keeps LoRA weights in fp32 over a bf16/fp16 base: the GradScaler
        # cannot unscale fp16 gradients ("Attempting to unscale FP16 gradients").
        model = get_peft_model(model, lora, autocast_adapter_dtype=True)
    start_lora(model, seed)
    return model


def apply_gradient_checkpointing(model: nn.Module, reentrant: bool = False) -> None:
    """Checkpoint every decoder layer; non-reentrant by default (DDP-safe: no "marked ready twice").

    Args:
        model: a transformers causal LM, or the peft model around one (peft forwards the calls).
        reentrant: use torch's older reentrant checkpointing instead.
    """
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        # transformers 5.x: gradient_checkpointing_enable is a deprecated alias (FutureWarning, gone in v6).
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers 4.x
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # With a frozen embedding nothing upstream of the first checkpointed block needs grad;
    # make its output require grad so that LoRA weights inside checkpointed blocks train.
    # (transformers 5.x's activation_checkpointing_enable does this too; 4.x only for its own peft integration.)
    model.enable_input_require_grads()


def _final_logit_softcap(config: PretrainedConfig) -> float | None:
    """Gemma 2's c in c·tanh(z/c) over the logits, which the head loss applies as the model does (None: no cap).

    Raises:
        ValueError: the model scales its logits some other way, which the head loss does not apply.
    """
    scaled = {key: getattr(config, key, 1.0) for key in ("logit_scale", "logits_scaling")}
    scaled = {key: value for key, value in scaled.items() if value not in (None, 1.0)}
    if scaled:
        raise ValueError(
            f"{config.model_type} scales its logits ({scaled}), which ddptrain's head loss does not apply: its loss "
            "would differ from the model's. Pick another model, or open an issue to have it supported."
        )
    return getattr(config, "final_logit_softcapping", None)


class CausalLMLoss(nn.Module):
    """Model + next-token loss; forward returns the *sum* of token losses and the token count.

    The LM head runs only on positions whose label is a target (prompt and padding
    positions are skipped): with a 150k vocabulary the head is most of a small model's
    arithmetic and, at long lengths, the largest activation. The loss is a sum, so the
    trainer can normalise once by the global token count of the optimizer step.
    """

    def __init__(self, model: nn.Module, loss_chunk_tokens: int = 0):
        super().__init__()
        self.model = model  # the peft model (or the plain model for a full fine-tune)
        causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.decoder = causal_lm.get_decoder()
        self.lm_head = causal_lm.get_output_embeddings()
        self.loss_chunk_tokens = loss_chunk_tokens
        self.softcap = _final_logit_softcap(causal_lm.config)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        target_index: torch.Tensor | None = None,
        **attention_kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss sum and number of target tokens (a CPU tensor) of a collated batch (``data.Collator``).

        ``target_index`` (from the collator) names the positions whose next label is a target: it
        belongs to the labels it was found in (pass None with other labels); ``attention_kwargs``
        are flash-attention's varlen lengths of a packed row.
        """
        return self.target_loss(
            self.hidden(input_ids, attention_mask, position_ids, **attention_kwargs), labels, target_index
        )

    def hidden(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        **attention_kwargs: Any,
    ) -> torch.Tensor:
        """The decoder's last hidden states."""
        return self.decoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **attention_kwargs,
        ).last_hidden_state

    # Eager under trainer.compile=true: the boolean mask gives a data-dependent shape (a graph break),
    # and a compiled head would recompile for every new target count until dynamo's limit.
    @torch.compiler.disable
    def target_loss(
        self, hidden: torch.Tensor, labels: torch.Tensor, target_index: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss sum and count of the target tokens: the next-token labels that are not IGNORE_INDEX (the count is a
        CPU tensor, from the index's shape: reading it never waits on the GPU)."""
        target_hidden, target_ids = self.targets(hidden, labels, target_index)
        return self.head_loss(target_hidden, target_ids), torch.tensor(target_ids.numel())

    @staticmethod
    def targets(
        hidden: torch.Tensor, labels: torch.Tensor, target_index: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden states of the positions whose next label is a target, and those labels.

        ``target_index``: flat positions (row × width + column) whose next label is a target. The
        collator finds them on the CPU; without it they are found here, which waits on the GPU.
        """
        if target_index is None:
            row, column = (labels[:, 1:] != IGNORE_INDEX).nonzero(as_tuple=True)
            target_index = row * labels.shape[1] + column
        target_hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, target_index)
        return target_hidden, labels.reshape(-1).index_select(0, target_index + 1)

    def eval_sums(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        target_index: torch.Tensor | None = None,
        **attention_kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Evaluation of a collated batch, without gradients: the loss sum, the targets the model's greedy guess gets
        right (``top1_correct``) and the number of targets."""
        hidden = self.hidden(input_ids, attention_mask, position_ids, **attention_kwargs)
        target_hidden, target_ids = self.targets(hidden, labels, target_index)
        weight = self.lm_head.weight
        if self.loss_chunk_tokens > 0 and type(self.lm_head) is nn.Linear and self.lm_head.bias is None:
            loss, correct = chunked_head_eval_sums(
                target_hidden, weight, target_ids, self.loss_chunk_tokens, self.softcap
            )
        else:
            logits = capped(self.lm_head(target_hidden).float(), self.softcap)
            loss = F.cross_entropy(logits, target_ids, reduction="sum")
            correct = top1_correct(logits, target_ids)
        return loss, correct, target_ids.numel()

    def head_loss(self, hidden: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        """Sum of cross-entropy losses of the LM head over target positions.

        With model.loss_chunk_tokens > 0 and a plain linear head, the head runs chunk by chunk
        and each chunk's gradient is formed at once, so the full (targets x vocab) logits never
        exist: same FLOPs, a fraction of the memory (``ChunkedHeadLoss``). Without gradients
        (evaluation) the chunks only sum the loss (``chunked_head_eval_sums``).
        """
        chunk = self.loss_chunk_tokens
        weight = self.lm_head.weight
        plain_head = type(self.lm_head) is nn.Linear and self.lm_head.bias is None
        if chunk > 0 and plain_head:
            if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
                return ChunkedHeadLoss.apply(hidden, weight, target_ids, chunk, self.softcap)
            return chunked_head_eval_sums(hidden, weight, target_ids, chunk, self.softcap)[0]
        return F.cross_entropy(capped(self.lm_head(hidden).float(), self.softcap), target_ids, reduction="sum")

    def close_window(self) -> dict[str, float]:
        """What the log window adds beyond the token loss: nothing (``PreferenceLoss`` adds the rewards)."""
        return {}

    def full_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits at every position (evaluation, tests, export checks)."""
        hidden = self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return capped(self.lm_head(hidden).float(), self.softcap)


def batch_to_device(batch: dict[str, Any], device: torch.device, compiled: bool) -> dict[str, Any]:
    """Tensors to the device; plain numbers (flash-attention's max lengths) stay as they are."""
    moved = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
    return mark_shapes_dynamic(moved) if compiled else moved


def mark_shapes_dynamic(batch: dict[str, Any]) -> dict[str, Any]:
    """For torch.compile: micro-batches differ in length, in number of targets and, packed, in number of samples:
    the last dimension of each tensor. Said up front, dynamo compiles the forward and backward once for any of them,
    instead of specialising on the first micro-batch and compiling everything again at the second (on 2 CPU ranks
    a test of an eager and a compiled 3-step run went from 80 s to 56 s). The rows of a micro-batch stay as
    automatic dynamic shapes leave them: static while they do not change, as with a fixed data.micro_batch_size."""
    for tensor in batch.values():
        if torch.is_tensor(tensor) and tensor.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(tensor, tensor.dim() - 1)
    return batch


def architecture_config(cfg: ModelConfig) -> PretrainedConfig:
    """The model's architecture config, without its weights: model.config_path (or model.name_or_path) for
    model.init=random; for pretrained weights the config next to them when it is at hand (a folder, the Hub
    cache), else model.config_path, else the config.json from the Hub."""
    if cfg.init == ModelInit.random:
        return AutoConfig.from_pretrained(cfg.config_path or cfg.name_or_path)
    try:
        return AutoConfig.from_pretrained(cfg.name_or_path, local_files_only=True)
    except OSError:
        if cfg.config_path:
            return AutoConfig.from_pretrained(cfg.config_path)
    return AutoConfig.from_pretrained(cfg.name_or_path)


def check_tokenizer_embeddable(tokenizer: PreTrainedTokenizerBase, cfg: ModelConfig) -> None:
    """``check_tokenizer_fits`` against the architecture config's vocab_size: before any weight loads or any row is
    tokenized (``build_model`` checks the built model's embedding again)."""
    check_tokenizer_fits(tokenizer, architecture_config(cfg).vocab_size, cfg)


def check_tokenizer_fits(tokenizer: PreTrainedTokenizerBase, model: nn.Module | int, cfg: ModelConfig) -> None:
    """Every token id the data can hold (tokenizer ids, pad and EOS) has a row in the model's input embedding
    (``model``: the model, or its number of embedding rows, e.g. the architecture config's vocab_size, so that the
    check runs before any weight is loaded or any row tokenized).

    Without this check a mismatched pair fails deep inside the first forward pass with
    "IndexError: index out of range in self" (CUDA: a device-side assert).

    Raises:
        ValueError: the tokenizer's ids reach past the embedding, naming both keys, both sizes and the fix.
    """
    rows = model if isinstance(model, int) else model.get_input_embeddings().num_embeddings
    special = {"pad": tokenizer.pad_token_id, "EOS": tokenizer.eos_token_id}
    needed = max([len(tokenizer)] + [i + 1 for i in special.values() if i is not None])
    if needed <= rows:
        return
    # The message stays on one line: the self-launcher reports the last line of each rank's error.
    ids = ", ".join(f"{name} id {i:,}" for name, i in special.items() if i is not None)
    source_key, source = "model.name_or_path", cfg.name_or_path
    if cfg.init == ModelInit.random and cfg.config_path is not None:
        source_key, source = "model.config_path", cfg.config_path
    tokenizer_setting = f"model.tokenizer={cfg.tokenizer or 'null (the tokenizer of model.name_or_path)'}"
    raise ValueError(
        f"{tokenizer_setting} has {len(tokenizer):,} tokens ({ids}) but {source_key}={source} embeds only "
        f"{rows:,} token ids: ids from {rows:,} up would crash the first forward pass. Use the model's own "
        "tokenizer (model.tokenizer=<the tokenizer the model was trained with>), or pick a model whose vocabulary "
        f"covers this tokenizer (at least {needed:,} embeddings)."
    )


def build_model(
    cfg: ModelConfig,
    seed: int,
    device: torch.device,
    tokenizer: PreTrainedTokenizerBase | None = None,
    load_on: torch.device | None = None,
    objective: ObjectiveConfig | None = None,
) -> nn.Module:
    """Base model -> LoRA (or full fine-tune) -> gradient checkpointing -> loss module, on ``device``.

    Args:
        cfg: the model group.
        seed: seeds random initialisation (model.init=random).
        device: where the loss module trains.
        tokenizer: the run's tokenizer; when given, checked against the model's embedding first.
        load_on: where the weights are built or loaded and the loss module stays, if not on ``device``
            (``parallel.load_device``: FSDP2 builds on the host, or on the meta device, and sharding moves each
            unit's shards to ``device``).
        objective: the objective group; objective=dpo wraps the causal LM's loss module in DPO's
            (``model/preference.py``).

    Raises:
        ValueError: the tokenizer's ids do not fit the model's input embedding (``check_tokenizer_fits``).
    """
    if cfg.liger_kernel:
        apply_liger_kernel(cfg, device)
    model = build_base_model(cfg, seed, load_on or device)
    if (
        load_on is not None
        and torch.device(load_on).type == "meta"
        and (why := why_not_by_rows(model, cfg.name_or_path))
    ):
        log.warning(
            "model: %s cannot be read row by row (%s): every rank loads it whole on its host", cfg.name_or_path, why
        )
        load_on = torch.device("cpu")
        model = build_base_model(cfg, seed, load_on)
    if tokenizer is not None:
        check_tokenizer_fits(tokenizer, model, cfg)
    if cfg.lora:
        model = apply_lora(model, cfg, seed)
    if cfg.gradient_checkpointing:
        apply_gradient_checkpointing(model, cfg.gradient_checkpointing_reentrant)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info("model: %s trainable of %s parameters (%.3f%%)", f"{trainable:,}", f"{total:,}", 100 * trainable / total)
    loss_module = CausalLMLoss(model, cfg.loss_chunk_tokens)
    if objective is not None and objective.name == Objective.dpo:
        loss_module = PreferenceLoss(loss_module, objective)
    where = torch.device(load_on or device)
    return loss_module if where.type == "meta" else loss_module.to(where)  # meta: its buffers stay on the host


def save_random_base(cfg: ModelConfig, seed: int, tokenizer: PreTrainedTokenizerBase, out_dir: Path) -> None:
    """Save the base a run's adapters load onto where no folder holds it: a random start, or the base with
    model.base_adapter merged in (``build_base_model`` builds either)."""
    base = build_base_model(cfg, seed)
    base.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def point_adapter_at_base(adapter_dir: Path, base_dir: str) -> None:
    """Record where the adapter's base model lives (peft reads base_model_name_or_path)."""
    config_file = adapter_dir / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = base_dir
    config_file.write_text(json.dumps(config, indent=2) + "\n")
