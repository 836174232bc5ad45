"""The ``trainer`` group's schema (``conf/trainer/``): the loop's length, precision, device, cadences, resume and
output, the end-of-run diagnosis thresholds (``trainer.diagnose``), and their checks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from ddptrain.config.checks import _positive


class Precision(str, Enum):
    auto = "auto"  # bf16 autocast on a CUDA device that supports it, else fp32 (resolve_precision)
    fp32 = "fp32"  # no autocast
    bf16 = "bf16"  # bf16 autocast
    fp16 = "fp16"  # fp16 autocast with a GradScaler


class Device(str, Enum):
    auto = "auto"  # cuda:LOCAL_RANK when CUDA is available, else cpu
    cpu = "cpu"
    cuda = "cuda"


class SaveCheckMode(str, Enum):
    every = "every"  # every save read back bit for bit; the plain peft/transformers round trip at the final save
    full = "full"  # the read-back and the round trip at every save
    final = "final"  # the read-back and the round trip at the final save; the read-back of a save for best/
    off = "off"


# "continue" is a Python keyword: the functional form names a member after it. OmegaConf reads a choice by its name.
OnNonFinite = Enum(
    "OnNonFinite",
    [("stop", "stop"), ("skip", "skip"), ("continue", "continue")],
    type=str,
    module=__name__,
)
OnNonFinite.__doc__ = """What a step whose gradient norm is not finite does (trainer.on_nonfinite): stop (its update is
dropped and every rank stops there), skip (its update is dropped and training goes on, up to trainer.max_skipped_steps
in a row) or continue (the update is applied, NaN and all)."""


EVAL_METRICS = {"eval_loss": False, "eval_perplexity": False, "eval_accuracy": True, "eval_rewards_accuracy": True}
"""What an evaluation measures, each with whether a greater value is better (trainer.best_metric)."""
PROMPT_FILE_TYPES = (".jsonl", ".txt")


@dataclass
class EarlyStoppingConfig:
    """End the run when trainer.best_metric stops improving (trainer.early_stopping.*)."""

    patience: int = 0
    """Evaluations in a row without an improvement of at least min_delta that end the run: every rank at the same
    step, after a checkpoint, exit code 0. 0 = never stop early. Needs trainer.eval_every_n_steps > 0."""
    min_delta: float = 0.0
    """The least change of trainer.best_metric, in its better direction, that counts as an improvement."""


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
    (torch.backends.cuda.matmul.allow_tf32): ~8x the fp32 peak, 10-bit mantissa inputs, fp32
    accumulation. false = IEEE fp32 matmuls. No effect on CPU."""
    device: Device = Device.auto
    seed: int = 42
    log_every_n_steps: int = 10
    eval_every_n_steps: int = 0
    """0 = evaluate only at the end (when there is an eval split)."""
    save_every_n_steps: int = 0
    """0 = save only at the end."""
    keep_last_n: int = 3
    """Checkpoints kept under <run>/checkpoints (older ones are deleted, unless trainer.keep_best_n keeps them)."""
    keep_best_n: int = 1
    """Checkpoints kept for their trainer.best_metric, besides the last trainer.keep_last_n; the best one's weights are
    also in <run>/best/ (best.json names its step). An evaluation that improves on them saves a checkpoint at once.
    0 = keep the last ones only, no best/. Nothing to rank without an eval split."""
    best_metric: str = "eval_loss"
    """What makes a checkpoint the best, and what early stopping watches: eval_loss, eval_perplexity or
    eval_accuracy (the share of target tokens the model's greedy guess gets right); objective=dpo: eval_loss or
    eval_rewards_accuracy (the share of pairs whose chosen reply gets the higher reward)."""
    greater_is_better: Optional[bool] = None
    """The direction of trainer.best_metric; null = by the metric (eval_accuracy: greater, the losses: lower)."""
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    """Stop when trainer.best_metric stops improving (trainer.early_stopping.patience, .min_delta)."""
    eval_prompts: Any = None
    """Prompts the model completes at every evaluation: a list (['Sort 3, 1, 2.', ...]) or a .txt file (a prompt a
    line) or .jsonl file (rows as data.path holds them: {"instruction", "input"}, {"messages"}, or {"prompt"}),
    rendered with the run's own template; greedy completions go to <run>/samples.jsonl and to each logger.
    null = none."""
    eval_max_new_tokens: int = 64
    """The longest completion of each trainer.eval_prompts prompt (greedy decoding; it stops earlier at the EOS)."""
    save_check: SaveCheckMode = SaveCheckMode.every
    """Prove the saves load as trained, in two ways. The read-back: the files as written hold the live trainable
    tensors bit for bit, under canonical keys (an adapter: its adapter_config.json names the run's base and LoRA
    settings); a few hundredths of a second for an adapter. The round trip: plain peft loads the adapter onto its base
    and computes the training model's logits on a probe batch, and the merged model holds each adapted weight as the
    merge must round it (a full fine-tune: plain transformers loads the model, every tensor bit for bit, tied head
    included); it loads the base again. every: the read-back at every save, the round trip too at the final save
    (adapter/; with trainer.save_final=false, the last step's checkpoint, which a run that saved any checkpoint then
    saves too); full: both at every save (a GPU run keeps the base loaded on the host between checks where host
    memory allows); final: both at the final save only, and the read-back of a save that becomes best/; off: none.
    best/ is a copy of a read-back checkpoint's files, verified byte for byte against its manifest."""
    save_timeout_s: int = 3600
    """How long the other ranks wait for rank 0 to write a checkpoint or the final weights. They wait through the
    store, not in a collective, so a save may outlast parallel.timeout_s (tens of GB on network storage); a save
    that fails ends every rank at once, with rank 0's error."""
    on_nonfinite: OnNonFinite = OnNonFinite.stop
    """A step whose gradient norm (over all ranks: a NaN or infinite loss on any rank makes it one) is not finite.
    stop: its update is dropped, every rank stops at that step, nothing more is saved, the last good checkpoint and
    best/ stay, and the run exits with code 65 naming the step, the first non-finite quantity and the levers. skip:
    its update is dropped (as fp16's loss scaler drops an overflowing step) and training goes on; trainer.
    max_skipped_steps in a row stop the run as above. continue: the update is applied (weights may turn NaN).
    Under trainer.precision=fp16 the loss scaler drops overflowing steps as part of its work, so stop and skip
    both stop only after trainer.max_skipped_steps in a row."""
    max_skipped_steps: int = 16
    """Steps in a row whose update was dropped (trainer.on_nonfinite=skip, or fp16 overflows) that stop the run.
    16: fp16's loss scale starts at 2^16 and halves at each overflow, so 16 in a row have taken it to 1."""
    resume: str = "auto"
    """auto: continue from this run directory's newest checkpoint, if any; none; or a checkpoint/run folder."""
    save_final: bool = True
    """Write the final weights to <run>/adapter (the adapter, or a full fine-tune's model; and <run>/base for a
    random-init LoRA model) when training ends."""
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


def _check_trainer(t: TrainerConfig) -> list[str]:
    problems = _positive({"trainer.max_steps": t.max_steps, "trainer.epochs": t.epochs})
    problems += _positive({"trainer.log_every_n_steps": t.log_every_n_steps, "trainer.keep_last_n": t.keep_last_n})
    problems += _positive(
        {"trainer.save_timeout_s": t.save_timeout_s, "trainer.eval_max_new_tokens": t.eval_max_new_tokens}
    )
    problems += _positive({"trainer.max_skipped_steps": t.max_skipped_steps})
    if t.resume not in ("auto", "none") and not os.path.exists(os.path.expanduser(t.resume)):
        problems.append(
            f"trainer.resume={t.resume}: no such folder. Use auto, none, or a run / checkpoints/step-N folder."
        )
    for key in ("eval_every_n_steps", "save_every_n_steps"):
        if getattr(t, key) < 0:
            problems.append(f"trainer.{key}={getattr(t, key)} must be 0 (only at the end) or more.")
    if t.peak_tflops is not None and t.peak_tflops <= 0:
        problems.append(f"trainer.peak_tflops={t.peak_tflops} must be positive, or null to look it up.")
    return problems + _check_profile(t) + _check_diagnose(t.diagnose) + _check_best(t) + _check_prompts(t.eval_prompts)


def _check_best(t: TrainerConfig) -> list[str]:
    problems = []
    if t.keep_best_n < 0:
        problems.append(f"trainer.keep_best_n={t.keep_best_n} must be 0 (no best checkpoints) or more.")
    if t.best_metric not in EVAL_METRICS:
        problems.append(f"trainer.best_metric={t.best_metric} is not measured: use one of {', '.join(EVAL_METRICS)}.")
    stopping = t.early_stopping
    if stopping.patience < 0:
        problems.append(f"trainer.early_stopping.patience={stopping.patience} must be 0 (off) or more evaluations.")
    if stopping.min_delta < 0:
        problems.append(
            f"trainer.early_stopping.min_delta={stopping.min_delta} must be 0 or more (an improvement, in the "
            "metric's better direction)."
        )
    if t.save_check == SaveCheckMode.final and not t.save_final:
        problems.append(
            "trainer.save_check=final checks the weights saved at the end, but trainer.save_final=false writes no "
            "adapter/: set trainer.save_check=every (each checkpoint read back, the last one's round trip) or off."
        )
    if stopping.patience > 0 and t.eval_every_n_steps == 0:
        problems.append(
            f"trainer.early_stopping.patience={stopping.patience} counts evaluations, but trainer.eval_every_n_steps=0 "
            "evaluates only at the end: set trainer.eval_every_n_steps=<steps between evaluations>."
        )
    return problems


def _check_prompts(prompts: Any) -> list[str]:
    """trainer.eval_prompts: null, a list of prompts (texts or rows), or a .txt / .jsonl file that exists."""
    if prompts is None:
        return []
    if isinstance(prompts, str):
        path = Path(prompts).expanduser()
        if path.suffix not in PROMPT_FILE_TYPES:
            return [
                f"trainer.eval_prompts={prompts}: a file of prompts must be .txt (one a line) or .jsonl (one row a "
                "line); for one prompt pass a list: trainer.eval_prompts='[Sort 3, 1, 2.]'."
            ]
        return [] if path.is_file() else [f"trainer.eval_prompts={prompts}: no such file."]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        return [f"trainer.eval_prompts must be a non-empty list of prompts or a .txt/.jsonl file, not {prompts!r}."]
    bad = [i for i, p in enumerate(prompts) if not (isinstance(p, str) and p.strip()) and not isinstance(p, dict)]
    if bad:
        return [f"trainer.eval_prompts: entries {bad} are neither text nor a row ({{instruction: ...}})."]
    return []


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
