"""Typed run configuration: one dataclass per Hydra config group.

The schemas are registered in Hydra's ConfigStore (``register_configs``) so that a
misspelled key, a wrong type or an unknown choice fails while Hydra composes the
config, before any worker starts. Checks that relate several fields live in
``validate``; it reports every problem at once, naming keys as the user types them.

This module imports neither torch nor transformers: config errors must surface in
well under a second. The exceptions are parallel.comm_hook=bf16_compress with
parallel.backend=auto, and model.attn_implementation=flash_attention_2, each with
trainer.device=auto, where only torch can say whether the workers will get CUDA;
torch is imported lazily for those cases alone.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, MissingMandatoryValue, OmegaConf

from ddptrain.batch_cost import cost_rule
from ddptrain.sources import resolve_source

ASSETS_DIR = Path(__file__).resolve().parent / "assets"


class ConfigError(ValueError):
    """One or more configuration problems, each naming the key and the fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(f"  - {p}" for p in problems))


# ----------------------------------------------------------------------------- choices


class ModelInit(str, Enum):
    pretrained = "pretrained"  # from_pretrained(model.name_or_path)
    random = "random"  # from_config(model.config_path): no weights needed


class DType(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Precision(str, Enum):
    auto = "auto"  # bf16 autocast on a CUDA device that supports it, else fp32 (resolve_precision)
    fp32 = "fp32"  # no autocast
    bf16 = "bf16"  # bf16 autocast
    fp16 = "fp16"  # fp16 autocast with a GradScaler


class Attention(str, Enum):
    sdpa = "sdpa"  # torch scaled_dot_product_attention
    eager = "eager"  # plain matmul + softmax (slow; for checks)
    flash_attention_2 = "flash_attention_2"  # needs the flash-attn package and a GPU


class Template(str, Enum):
    alpaca = "alpaca"  # instruction / input / output rows
    chat = "chat"  # rows with a list of {"role", "content"} messages (OpenAI style)
    sharegpt = "sharegpt"  # rows with a list of {"from": human|gpt|system, "value"} turns
    text = "text"  # plain text: loss on every token (continued pre-training)


class Batching(str, Enum):
    random = "random"  # shuffled, fixed rows per micro-batch
    length_grouped = "length_grouped"  # similar lengths share a micro-step
    token_budget = "token_budget"  # rows x padded length <= data.max_tokens_per_batch
    packed = "packed"  # samples concatenated without padding


class Backend(str, Enum):
    auto = "auto"  # nccl on CUDA, gloo on CPU
    nccl = "nccl"
    gloo = "gloo"


class StartMethod(str, Enum):
    spawn = "spawn"  # each rank a fresh interpreter that imports torch, transformers and peft itself
    forkserver = "forkserver"  # one server process imports them once; each rank (and restart) is a fork of it


class CommHook(str, Enum):
    none = "none"
    fp16_compress = "fp16_compress"
    bf16_compress = "bf16_compress"
    powersgd = "powersgd"


class Scheduler(str, Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class Device(str, Enum):
    auto = "auto"  # cuda:LOCAL_RANK when CUDA is available, else cpu
    cpu = "cpu"
    cuda = "cuda"


# ----------------------------------------------------------------------------- groups


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


@dataclass
class SourceConfig:
    """One dataset of a mixture (``data.sources``); a key left null takes the value of data.<key>."""

    path: str = MISSING
    """A file, a glob, a folder or a Hub dataset id, as data.path takes."""
    weight: Optional[float] = None
    """Share of the mixture (weights are normalised); a source short of rows is repeated to reach it."""
    max_rows: Optional[int] = None
    """Read at most the first N rows of this source."""
    subset: Optional[str] = None
    split: Optional[str] = None
    template: Optional[Template] = None
    eval_fraction: Optional[float] = None
    """Share of this source held out for evaluation (the eval split is taken per source)."""
    instruction_field: Optional[str] = None
    input_field: Optional[str] = None
    output_field: Optional[str] = None
    messages_field: Optional[str] = None
    conversations_field: Optional[str] = None
    role_field: Optional[str] = None
    content_field: Optional[str] = None
    text_field: Optional[str] = None


@dataclass
class DataConfig:
    path: Optional[str] = MISSING
    """Training rows, read through datasets: a .json, .jsonl, .parquet or .csv file; a glob of such files
    (data/*.jsonl: one type, sorted order); a local folder (read as a Hub dataset repository is: its
    README's configs, files named by split, or every data file as 'train'); or a Hub dataset id
    (tatsu-lab/alpaca). A path that starts with ., / or ~, or ends in a data-file type, must exist
    locally; anything else is a Hub id. HF_HUB_OFFLINE=1 / HF_DATASETS_OFFLINE=1 are honoured: a Hub id is
    then read from the local caches (hf download --repo-type dataset <id> fills them). null with data.sources."""
    subset: Optional[str] = None
    """Config (subset) of a folder or Hub dataset, datasets' load_dataset(name=...); null = its default.
    Files and globs have none: it must stay null unless data.path or data.eval_path is a folder or Hub id."""
    split: str = "train"
    """Split of a folder or Hub dataset (data.path and data.eval_path alike). A file or glob is read whole,
    as datasets' 'train' split: any other value is refused unless data.path or data.eval_path is a folder
    or Hub id."""
    eval_path: Optional[str] = None
    """Held-out rows, in any form data.path takes (a folder or Hub id read with data.subset and
    data.split); null = hold out data.eval_fraction of data.path."""
    eval_fraction: float = 0.0
    """Share of data.path held out for evaluation when data.eval_path is null."""
    template: Template = Template.alpaca
    instruction_field: str = "instruction"
    input_field: str = "input"
    """Optional field: rows without it, or with it empty, use the no-input prompt."""
    output_field: str = "output"
    messages_field: str = "messages"
    """template=chat: the field holding the list of {"role", "content"} messages."""
    conversations_field: str = "conversations"
    """template=sharegpt: the field holding the list of turns."""
    role_field: str = "from"
    """template=sharegpt: the key of a turn's speaker (human, gpt, system; user and assistant also work)."""
    content_field: str = "value"
    """template=sharegpt: the key of a turn's text."""
    text_field: str = "text"
    """template=text: the field holding the text (every token is trained on, EOS appended)."""
    chat_template: Optional[str] = None
    """chat and sharegpt rows: null = the tokenizer's own chat template (ChatML when it has none);
    a Jinja string or a path to a .jinja file; chatml = ChatML whatever the tokenizer has."""
    max_length: int = 1024
    """Longer rows are truncated (counted and reported)."""
    max_rows: Optional[int] = None
    """Use only the first N rows of data.path (quick runs); null = all."""
    micro_batch_size: int = 8
    """Rows per rank per forward pass (random and length_grouped batching)."""
    batching: Batching = Batching.length_grouped
    max_tokens_per_batch: int = 8192
    """token_budget / packed: padded tokens per rank per forward pass never exceed this."""
    pad_to_multiple_of: int = 1
    """Round padded lengths up to a multiple of this (e.g. 8 for tensor-core shapes); costs ~3% padding on Alpaca."""
    costliest_first: bool = True
    """Put the micro-step with the most padded tokens first, so an OOM shows at step 1."""
    skip_bad_rows: bool = False
    """false: a malformed row is an error naming file and line; true: skip it and log a count."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0 = collate in the training process)."""
    cache_dir: Optional[str] = None
    """datasets cache for tokenized data; null = the datasets default (~/.cache/huggingface)."""
    prepare_timeout_s: int = 3600
    """How long other ranks wait while local rank 0 tokenizes the dataset."""
    num_proc: Optional[int] = None
    """Processes that tokenize a large file (datasets' map workers, on local rank 0 only); null = 1."""
    sources: list[SourceConfig] = field(default_factory=list)
    """A mixture instead of data.path: several datasets, each with its own path, template and field
    names (unset ones come from data.*) and either a weight (its share of the mixture) or max_rows."""


@dataclass
class ParallelConfig:
    nproc_per_node: Optional[int] = 1
    """Processes on this machine; null = adopt torchrun's count (or 1 when self-launched)."""
    backend: Backend = Backend.auto
    timeout_s: int = 600
    """Collective timeout: a hung rank fails the run after this many seconds, not days."""
    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    """Only when some trainable parameter gets no gradient (the pre-flight says when)."""
    static_graph: bool = False
    """DDP's static-graph mode; refused with optim.grad_accum_steps > 1 (PyTorch's reducer asserts under no_sync)."""
    gradient_as_bucket_view: bool = True
    """Gradients alias DDP's all-reduce buckets: saves one gradient copy of memory."""
    broadcast_buffers: bool = False
    """true: DDP sends rank 0's buffers to every rank before the forward that syncs gradients, a blocking
    collective per optimizer step where every rank waits for the slowest.
    Decoder LMs hold only constant buffers (rotary frequencies), proven equal on every rank at start-up;
    true for models whose buffers change while training (BatchNorm statistics)."""
    comm_hook: CommHook = CommHook.none
    """Compress gradients before all-reduce (bf16_compress needs nccl)."""
    powersgd_rank: int = 1
    max_restarts: int = 0
    """Self-launch only: restart the worker group this many times after a failure."""
    start_method: StartMethod = StartMethod.spawn
    """Self-launch only: how the workers start. ``forkserver`` imports the libraries once in a server process and
    forks each rank from it, restarts included: every launch after a process's first skips the imports (each further
    2-rank job of a sweep 2.4 s instead of 7.0 s on 2 cores, bench/README.md)."""


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 2e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    scheduler: Scheduler = Scheduler.cosine
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    """Final LR as a fraction of optim.lr (cosine and linear)."""
    grad_accum_steps: int = 1
    """Micro-steps per optimizer step; gradients sync once per optimizer step."""
    global_batch_size: Optional[int] = None
    """Samples per optimizer step over all ranks; when set, optim.grad_accum_steps is derived from it, the
    number of processes and data.micro_batch_size (random and length_grouped batching only)."""
    max_grad_norm: Optional[float] = 1.0
    """Clip the global gradient norm; null = no clipping."""


@dataclass
class DiagnoseConfig:
    """Thresholds of the end-of-run verdict (ddptrain.diagnose); each is a share of the measured step time
    unless it says otherwise. The verdict is ``memory`` when that fires (a run about to fail comes first),
    else the largest loss of time that crosses its threshold, else ``compute`` (docs/diagnostics.md)."""

    data_share: float = 0.10
    """Verdict ``data`` when waiting on the loader takes at least this share of a step."""
    comm_share: float = 0.15
    """Verdict ``communication`` when all-reduce time left exposed after backward takes at least this share."""
    rank_time_imbalance: float = 1.15
    """Verdict ``imbalance`` or ``straggler`` when the slowest rank's busy time / the mean is at least this."""
    planned_share: float = 0.5
    """``imbalance`` (the batch plan) rather than ``straggler`` (the rank itself) when the planned
    rank_imbalance accounts for at least this share of the measured excess."""
    memory_fraction: float = 0.92
    """Verdict ``memory`` when a rank's reserved memory reaches this fraction of the device, or the
    allocator had to retry (free its cache) to satisfy a request."""


@dataclass
class TensorBoardLoggerConfig:
    log_dir: str = "tensorboard"
    """Event files go here, relative to the run folder."""


@dataclass
class WandbLoggerConfig:
    project: str = "ddptrain"
    """The W&B project the run goes to."""
    entity: Optional[str] = None
    """The W&B team or user; null = your default entity."""
    name: Optional[str] = None
    """The W&B run name; null = the run folder's name."""
    mode: Optional[str] = None
    """online | offline | disabled; null = W&B's own default (WANDB_MODE, else online)."""
    tags: list[str] = field(default_factory=list)
    """Tags on the W&B run."""


@dataclass
class MlflowLoggerConfig:
    tracking_uri: Optional[str] = None
    """null = a SQLite store inside the run folder (<run>/mlflow.db); or a server such as http://host:5000."""
    experiment_name: str = "ddptrain"
    """The MLflow experiment the run is filed under (created when missing)."""
    run_name: Optional[str] = None
    """null = the run folder's name."""


@dataclass
class LoggerConfig:
    """Where metrics go besides metrics.jsonl (always written): logger=tensorboard, logger=[tensorboard,wandb]."""

    tensorboard: Optional[TensorBoardLoggerConfig] = None
    wandb: Optional[WandbLoggerConfig] = None
    mlflow: Optional[MlflowLoggerConfig] = None


@dataclass
class TrainerConfig:
    max_steps: Optional[int] = None
    """Optimizer steps to run; null = run trainer.epochs full epochs."""
    epochs: int = 1
    precision: Precision = Precision.auto
    """The forward pass's autocast dtype. auto: bf16 on a CUDA device that supports it (Ampere and newer), fp32
    (no autocast) on CPU and older GPUs; the run log and config.yaml show what it became. bf16; fp16 (autocast
    with a GradScaler; needed by model.dtype=fp16); fp32 = no autocast, matmuls in the weights' dtype."""
    tf32: bool = True
    """fp32 matmuls and convolutions on a CUDA GPU that has TF32 tensor cores (Ampere and newer) run in TF32
    (torch.backends.cuda.matmul.fp32_precision="tf32"): ~8x the fp32 peak, 10-bit mantissa inputs, fp32
    accumulation. false = IEEE fp32 matmuls. No effect on CPU."""
    device: Device = Device.auto
    seed: int = 42
    log_every_n_steps: int = 10
    eval_every_n_steps: int = 0
    """0 = evaluate only at the end (when there is an eval split)."""
    save_every_n_steps: int = 0
    """0 = save only at the end."""
    keep_last_n: int = 3
    """Checkpoints kept under <run>/checkpoints (older ones are deleted)."""
    save_timeout_s: int = 3600
    """How long the other ranks wait for rank 0 to write a checkpoint or the final weights. They wait through the
    store, not in a collective, so a save may outlast parallel.timeout_s (tens of GB on network storage); a save
    that fails ends every rank at once, with rank 0's error."""
    resume: str = "auto"
    """auto: continue from this run directory's newest checkpoint, if any; none; or a checkpoint/run folder."""
    save_final: bool = True
    """Write <run>/adapter (and <run>/base for a random-init model) when training ends."""
    output_dir: str = "outputs"
    """Runs go to <output_dir>/<date>_<time>, sweeps to <output_dir>/multirun/..."""
    progress_bar: bool = True
    compile: bool = False
    """torch.compile the model (first steps are slow while it compiles)."""
    timing: bool = True
    """Measure where each step's time goes (data, compute, exposed communication, optimizer), FLOP/s and
    memory per rank, and write the diagnosis (report.md) at the end. false: tokens/s and loss only."""
    peak_tflops: Optional[float] = None
    """The device's dense peak TFLOP/s (for mfu); null = looked up from the GPU's name for the dtype the matmuls run
    in: the autocast dtype (trainer.precision), else model.dtype (TF32's peak for fp32 with trainer.tf32=true).
    On CPU mfu stays null unless this is set."""
    profile_steps: Optional[list[int]] = None
    """[START, END]: a torch.profiler trace of optimizer steps START..END (1-based, inclusive) under
    <run>/profile/; null = no profiling."""
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    """The global ranks that write a profiler trace when trainer.profile_steps is set."""
    diagnose: DiagnoseConfig = field(default_factory=DiagnoseConfig)
    """Thresholds of the end-of-run verdict (report.md; docs/diagnostics.md)."""


@dataclass
class RunConfig:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    parallel: ParallelConfig = MISSING
    optim: OptimConfig = MISSING
    trainer: TrainerConfig = MISSING
    logger: LoggerConfig = field(default_factory=LoggerConfig)


# ----------------------------------------------------------------------------- checks


def validate(cfg: RunConfig) -> None:
    """Check relations between fields; raise ConfigError listing every problem.

    Raises:
        ConfigError: with one line per problem, each naming the key and the fix.
    """
    problems = (
        _check_model(cfg.model, cfg.parallel, cfg.trainer)
        + _check_data(cfg.data)
        + _check_chat_template(cfg.data)
        + _check_sources(cfg.data)
        + _check_parallel(cfg.parallel, cfg.trainer, cfg.optim.grad_accum_steps)
        + _check_optim(cfg.optim, cfg.data)
        + _check_trainer(cfg.trainer)
        + _check_loggers(cfg.logger)
    )
    if problems:
        raise ConfigError(problems)


def _positive(values: dict[str, Any]) -> list[str]:
    return [f"{key}={v} must be a positive integer." for key, v in values.items() if v is not None and v < 1]


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
    return problems + _check_precision(m, t) + _check_compile(m, p, t)


def _check_precision(m: ModelConfig, t: TrainerConfig) -> list[str]:
    """Weights whose dtype the run cannot train correctly: low-precision trainable weights, fp16 without a scaler."""
    if m.dtype != DType.fp32 and not m.lora:
        # AdamW steps the weights in their own dtype: an update of 1e-5 on a bf16 weight of 0.02 (8 bits of
        # mantissa) rounds to nothing, and GradScaler refuses to unscale fp16 gradients.
        scaler = ", and GradScaler cannot unscale fp16 gradients" if m.dtype == DType.fp16 else ""
        return [
            f"model.dtype={m.dtype.value} with model.lora=false makes the optimizer update {m.dtype.value} weights: "
            f"small updates round to nothing and the model silently stops learning{scaler}. Train fp32 weights under "
            "autocast: model.dtype=fp32 trainer.precision=bf16 (or auto on a bf16 GPU), or keep model.lora=true."
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
    version = installed_torch_version()
    if version is None or version >= COMPILE_CHECKPOINTING_MIN_TORCH:
        return []
    found = ".".join(map(str, version))
    return [
        f"trainer.compile=true with model.gradient_checkpointing=true under DDP crashes on torch {found} "
        '("DDPOptimizer backend: Found a higher order op in the graph", fixed in torch 2.6): upgrade torch to '
        "2.6 or newer, or set trainer.compile=false, or model.gradient_checkpointing=false."
    ]


def installed_torch_version() -> tuple[int, int] | None:
    """(major, minor) of the installed torch, read from its package metadata: importing torch takes seconds."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = re.match(r"(\d+)\.(\d+)", version("torch"))
    except PackageNotFoundError:
        return None
    return (int(found.group(1)), int(found.group(2))) if found else None


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
    elif t.device == Device.auto and not _cuda_available():
        why = "trainer.device=auto means cpu here (no CUDA device is visible)"
    else:
        return problems
    problems.append(
        f"model.attn_implementation=flash_attention_2 needs a CUDA device, but {why}: "
        "use model.attn_implementation=sdpa on CPU, or train on GPUs."
    )
    return problems


def _check_data(d: DataConfig) -> list[str]:
    problems = _positive(
        {
            "data.max_length": d.max_length,
            "data.micro_batch_size": d.micro_batch_size,
            "data.max_tokens_per_batch": d.max_tokens_per_batch,
            "data.pad_to_multiple_of": d.pad_to_multiple_of,
            "data.max_rows": d.max_rows,
            "data.num_proc": d.num_proc,
        }
    )
    if not 0.0 <= d.eval_fraction < 1.0:
        problems.append(f"data.eval_fraction={d.eval_fraction} must be in [0, 1).")
    longest_row = cost_rule(d.batching == Batching.packed, max(d.pad_to_multiple_of, 1))([d.max_length])
    if d.batching in (Batching.token_budget, Batching.packed) and d.max_tokens_per_batch < longest_row:
        problems.append(
            f"data.max_tokens_per_batch={d.max_tokens_per_batch} is below data.max_length={d.max_length} "
            f"({longest_row} tokens as a micro-batch): one full-length row would not fit; raise "
            "data.max_tokens_per_batch or lower data.max_length."
        )
    problems += _check_paths(d)
    if d.num_workers < 0:
        problems.append(f"data.num_workers={d.num_workers} must be 0 or more.")
    return problems


def _check_chat_template(d: DataConfig) -> list[str]:
    """data.chat_template: chatml, a Jinja template (it has {{ or {%), or a file that exists."""
    value = d.chat_template
    if value is None or value == "chatml" or is_jinja(value) or os.path.isfile(os.path.expanduser(value)):
        return []
    return [
        f"data.chat_template={value}: no such file, and not a Jinja template (no {{{{ or {{%). Point it at a "
        ".jinja file, give the template itself, or use data.chat_template=chatml (or null: the tokenizer's own)."
    ]


def _check_sources(d: DataConfig) -> list[str]:
    """data.sources: instead of data.path, weights on all sources or none."""
    if not d.sources:
        return [] if d.path is not None else ["data.path is required: data.path=<file, glob, folder or hub id>."]
    problems = []
    if d.path is not None:
        problems.append(
            f"data.sources and data.path={d.path} are both set: a mixture reads only data.sources. Set "
            "data.path=null (data=mixture does), or drop data.sources."
        )
    if d.max_rows is not None:
        problems.append(
            f"data.max_rows={d.max_rows} applies to data.path, not to a mixture: set data.sources[k].max_rows on "
            "the sources to cut, and data.max_rows=null."
        )
    for key, value, default in (("data.split", d.split, "train"), ("data.subset", d.subset, None)):
        if value != default:
            problems.append(f"{key}={value} applies to data.path, not to a mixture: set data.sources[k].{key[5:]}.")
    weights = [s.weight for s in d.sources]
    if any(w is None for w in weights) and any(w is not None for w in weights):
        problems.append(
            f"data.sources: weights {weights} are set on some sources only: give every source a weight (its share "
            "of the mixture), or none (every row of every source, once)."
        )
    return problems + [problem for k, source in enumerate(d.sources) for problem in _check_source(k, source)]


def _check_source(k: int, source: SourceConfig) -> list[str]:
    """One entry of data.sources: a path that can be read, settings in range, split/subset only where they act."""
    key = f"data.sources[{k}]"
    problems = _positive({f"{key}.max_rows": source.max_rows})
    if source.weight is not None and source.weight <= 0:
        problems.append(f"{key}.weight={source.weight} must be positive.")
    if source.eval_fraction is not None and not 0.0 <= source.eval_fraction < 1.0:
        problems.append(f"{key}.eval_fraction={source.eval_fraction} must be in [0, 1).")
    try:
        files_only = not resolve_source(source.path, f"{key}.path").has_splits
    except ValueError as err:
        return [*problems, str(err)]
    if files_only and (source.split not in (None, "train") or source.subset is not None):
        problems.append(
            f"{key} sets split={source.split} / subset={source.subset}, which have no effect: "
            f"{source.path} names files, read whole. Remove them, or point the source at a folder or Hub dataset."
        )
    return problems


def is_jinja(text: str) -> bool:
    """Whether a data.chat_template value is a template rather than a file name."""
    return "{{" in text or "{%" in text


def _check_paths(d: DataConfig) -> list[str]:
    """Local paths must exist (Hub ids are checked when loaded); data.subset/split need a folder or Hub id."""
    problems, sources = [], {}
    for key, value in (("data.path", d.path), ("data.eval_path", d.eval_path)):
        try:
            sources.update({key: resolve_source(value, key)} if value is not None else {})
        except ValueError as err:
            problems.append(str(err))
    if problems or not sources or any(s.has_splits for s in sources.values()):
        return problems
    names = " and ".join(f"{key}={s.path}" for key, s in sources.items())
    for key, value, default in (("data.split", d.split, "train"), ("data.subset", d.subset, None)):
        if value != default:
            problems.append(
                f"{key}={value} has no effect: {names} names files, which are read whole (as datasets' 'train' "
                f"split). Remove {key}, or point data.path at a folder or Hub dataset that has it."
            )
    return problems


def _check_parallel(p: ParallelConfig, t: TrainerConfig, grad_accum_steps: int) -> list[str]:
    problems = _positive({"parallel.nproc_per_node": p.nproc_per_node, "parallel.timeout_s": p.timeout_s})
    if p.static_graph and grad_accum_steps > 1:
        # PyTorch's reducer with static_graph does not expect no_sync micro-steps: the first backward
        # dies with "expect_autograd_hooks_ INTERNAL ASSERT FAILED" (reducer.cpp).
        problems.append(
            f"parallel.static_graph=true with optim.grad_accum_steps={grad_accum_steps} crashes DDP at the first "
            "backward (PyTorch's static graph does not support no_sync accumulation): set "
            "parallel.static_graph=false, or optim.grad_accum_steps=1."
        )
    # Only bf16_compress needs the backend that parallel.backend=auto will pick (and so, maybe, torch).
    if p.comm_hook == CommHook.bf16_compress and _resolved_backend(p.backend, t.device) == Backend.gloo:
        if p.backend == Backend.gloo:
            why = "parallel.backend=gloo"
        elif t.device == Device.cpu:
            why = "parallel.backend=auto means gloo with trainer.device=cpu"
        else:
            why = "parallel.backend=auto means gloo here (trainer.device=auto and no CUDA device is visible)"
        problems.append(
            f"parallel.comm_hook=bf16_compress needs NCCL (PyTorch's hook refuses gloo), but {why}: "
            "use parallel.comm_hook=fp16_compress (or none) on CPU, or train on GPUs with parallel.backend=nccl."
        )
    if p.max_restarts < 0:
        problems.append(f"parallel.max_restarts={p.max_restarts} must be 0 or more.")
    return problems


def _check_optim(o: OptimConfig, d: DataConfig) -> list[str]:
    problems = _positive({"optim.grad_accum_steps": o.grad_accum_steps, "optim.global_batch_size": o.global_batch_size})
    if o.global_batch_size is not None and d.batching in (Batching.token_budget, Batching.packed):
        problems.append(
            f"optim.global_batch_size={o.global_batch_size} counts samples, but data.batching={d.batching.value} "
            "puts a varying number of samples in each micro-batch: set optim.global_batch_size=null and use "
            "optim.grad_accum_steps (a step then holds up to processes × grad_accum_steps × "
            "data.max_tokens_per_batch tokens), or data.batching=length_grouped."
        )
    if o.name != "adamw":
        problems.append(f"optim.name={o.name} is not available: use optim=adamw.")
    if o.lr <= 0:
        problems.append(f"optim.lr={o.lr} must be positive.")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        problems.append(f"optim.betas={o.betas} must be two numbers in [0, 1), e.g. optim.betas=[0.9,0.999].")
    if o.warmup_steps < 0:
        problems.append(f"optim.warmup_steps={o.warmup_steps} must be 0 or more.")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        problems.append(f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1].")
    if o.max_grad_norm is not None and o.max_grad_norm <= 0:
        problems.append(f"optim.max_grad_norm={o.max_grad_norm} must be positive, or null to disable clipping.")
    return problems


def _check_trainer(t: TrainerConfig) -> list[str]:
    problems = _positive({"trainer.max_steps": t.max_steps, "trainer.epochs": t.epochs})
    problems += _positive({"trainer.log_every_n_steps": t.log_every_n_steps, "trainer.keep_last_n": t.keep_last_n})
    problems += _positive({"trainer.save_timeout_s": t.save_timeout_s})
    if t.resume not in ("auto", "none") and not os.path.exists(os.path.expanduser(t.resume)):
        problems.append(
            f"trainer.resume={t.resume}: no such folder. Use auto, none, or a run / checkpoints/step-N folder."
        )
    for key in ("eval_every_n_steps", "save_every_n_steps"):
        if getattr(t, key) < 0:
            problems.append(f"trainer.{key}={getattr(t, key)} must be 0 (only at the end) or more.")
    if t.peak_tflops is not None and t.peak_tflops <= 0:
        problems.append(f"trainer.peak_tflops={t.peak_tflops} must be positive, or null to look it up.")
    return problems + _check_profile(t) + _check_diagnose(t.diagnose)


def _check_diagnose(d: DiagnoseConfig) -> list[str]:
    problems = [
        f"trainer.diagnose.{key}={getattr(d, key)} must be in (0, 1]."
        for key in ("data_share", "comm_share", "planned_share", "memory_fraction")
        if not 0 < getattr(d, key) <= 1
    ]
    if d.rank_time_imbalance <= 1:
        problems.append(
            f"trainer.diagnose.rank_time_imbalance={d.rank_time_imbalance} must be above 1 "
            "(slowest rank's busy time / the mean; 1.15 = 15% slower)."
        )
    return problems


def _check_profile(t: TrainerConfig) -> list[str]:
    if t.profile_steps is None:
        return []
    steps, problems = list(t.profile_steps), []
    if len(steps) != 2 or not 1 <= steps[0] <= steps[1]:
        problems.append(f"trainer.profile_steps={steps} must be [START, END] with 1 <= START <= END, e.g. [3,5].")
    elif t.max_steps is not None and steps[0] > t.max_steps:
        problems.append(
            f"trainer.profile_steps={steps} starts after trainer.max_steps={t.max_steps}: nothing would be traced."
        )
    if any(rank < 0 for rank in t.profile_ranks):
        problems.append(f"trainer.profile_ranks={list(t.profile_ranks)} must list global ranks (0 or more).")
    return problems


# The package each logger needs, and the extra that installs it.
_LOGGER_PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}


def _check_loggers(cfg: LoggerConfig) -> list[str]:
    """Each chosen logger's package is importable: a missing one fails here, not in the middle of training."""
    import importlib.util

    problems = []
    for name, (module, extra) in _LOGGER_PACKAGES.items():
        if getattr(cfg, name) is not None and importlib.util.find_spec(module) is None:
            problems.append(f"logger={name} needs the {module} package: pip install 'ddptrain[{extra}]'.")
    return problems


def _resolved_backend(backend: Backend, device: Device) -> Backend:
    """What parallel.backend=auto becomes in the workers (ddptrain.parallel picks the same way)."""
    if backend != Backend.auto:
        return backend
    on_cuda = device == Device.cuda or (device == Device.auto and _cuda_available())
    return Backend.nccl if on_cuda else Backend.gloo


def _cuda_available() -> bool:
    # Imported here, and only for the checks that need it: torch takes seconds to import.
    import torch

    return torch.cuda.is_available()


def _looks_local(path: str) -> bool:
    return os.path.exists(os.path.expanduser(path))


# ----------------------------------------------------------------------------- hydra glue


def _asset(name: str) -> str:
    """``${asset:tiny_qwen2}``: absolute path of a file or folder shipped in ddptrain/assets."""
    path = ASSETS_DIR / name
    if not path.exists():
        available = ", ".join(sorted(p.name for p in ASSETS_DIR.iterdir()))
        raise ValueError(f"${{asset:{name}}}: no such bundled asset. Available: {available}.")
    return str(path)


# ``python -m ddptrain``'s command line, for the processes that run a sweep's jobs and resolve their folder names
# (``swept_overrides``): submitit's job processes have their own argv, and inherit the environment.
COMMAND_LINE_ENV = "DDPTRAIN_COMMAND_LINE"


def swept_overrides(task_overrides: list[str], argv: list[str] | None = None) -> str:
    """``${swept:${hydra.overrides.task}}``: a sweep job's folder name from the keys the command line sweeps.

    ``key=value`` of each swept key (swept on the command line, or set by the sweeper: ``hydra.sweeper.params``,
    an Optuna trial), sorted, joined by commas; overrides that every job shares (``trainer.progress_bar=false``)
    would only lengthen every name. A ``/`` in a value becomes ``_``, so a
    swept path does not nest folders.

    Args:
        task_overrides: this job's overrides (``hydra.overrides.task``).
        argv: the command line; None = ``sys.argv`` (Hydra's launchers resolve folder names in the process
            that parsed it).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if argv is None:  # a job run by another process (submitit, a parallel sweep) reads its sweep's command line
        argv = json.loads(os.environ[COMMAND_LINE_ENV]) if COMMAND_LINE_ENV in os.environ else sys.argv
    # Overrides only: not the flags, nor the values some take (``--config-dir recipes``).
    args = [a for a in argv[1:] if not a.startswith("-") and ("=" in a or a.startswith("~"))]
    try:
        parsed = OverridesParser.create().parse_overrides(args)
    except Exception:  # a command line Hydra itself will reject: it says why
        parsed = []
    swept = {o.key_or_group for o in parsed if o.is_sweep_override()}
    given = {o.key_or_group for o in parsed}
    # Swept on the command line, or set by the sweeper itself (hydra.sweeper.params, Optuna's trials).
    named = [o for o in task_overrides if (key := o.split("=", 1)[0].lstrip("+~")) in swept or key not in given]
    return ",".join(sorted(named)).replace("/", "_")


def register_configs() -> None:
    """Register the root schema (``run_schema``, first in conf/train.yaml's defaults) and the ``asset`` and
    ``swept`` resolvers.

    The group fields of RunConfig are typed, so every group's YAML is checked against its
    dataclass when Hydra merges it. Idempotent.
    """
    if not OmegaConf.has_resolver("asset"):
        OmegaConf.register_new_resolver("asset", _asset)
    if not OmegaConf.has_resolver("swept"):
        OmegaConf.register_new_resolver("swept", swept_overrides)
    ConfigStore.instance().store(name="run_schema", node=RunConfig)


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Turn a composed DictConfig into typed dataclasses (resolving interpolations) and validate."""
    try:
        run = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as err:
        raise ConfigError([f"{err.full_key} is required: add {err.full_key}=<value> to the command line."]) from None
    assert isinstance(run, RunConfig), type(run)
    validate(run)
    return run


def resolve_global_batch_size(cfg: RunConfig, world_size: int) -> RunConfig:
    """The run config with optim.grad_accum_steps derived from optim.global_batch_size (when it is set).

    Args:
        cfg: a validated run config.
        world_size: the number of processes of the job (all nodes).

    Raises:
        ConfigError: optim.grad_accum_steps set as well, or a global batch that the processes and
            data.micro_batch_size do not divide (naming all three and the nearest values that work).
    """
    o, d = cfg.optim, cfg.data
    if o.global_batch_size is None:
        return cfg
    per_step = world_size * d.micro_batch_size
    if o.grad_accum_steps != 1:
        raise ConfigError(
            [
                f"optim.global_batch_size={o.global_batch_size} and optim.grad_accum_steps={o.grad_accum_steps} are "
                "both set: the first derives the second. Keep one of them."
            ]
        )
    if o.global_batch_size % per_step:
        lower = max(per_step, o.global_batch_size // per_step * per_step)
        raise ConfigError(
            [
                f"optim.global_batch_size={o.global_batch_size} is not a multiple of {world_size} processes × "
                f"data.micro_batch_size={d.micro_batch_size} = {per_step} samples per micro-step: set "
                f"optim.global_batch_size={lower} or {lower + per_step}, or change data.micro_batch_size or the "
                "number of processes (parallel.nproc_per_node)."
            ]
        )
    derived = replace(o, grad_accum_steps=o.global_batch_size // per_step)
    resolved = replace(cfg, optim=derived)
    validate(resolved)  # the derived accumulation meets the checks a given one does (parallel.static_graph)
    return resolved


def config_as_dict(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config as plain nested dicts (enums as their names): what the loggers record."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)


def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML (what the run directory's config.yaml holds)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
