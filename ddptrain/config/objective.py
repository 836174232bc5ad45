"""The ``objective`` group's schema (``conf/objective/``): what the model is trained to do. ``sft``: next-token loss
on the trained tokens (the default). ``dpo``: Direct Preference Optimization on pairs of replies to one prompt
(``data.template=preference``) against a reference: the same model with its LoRA adapter switched off, or the base's
log-probabilities computed once before training (``objective.reference``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ddptrain.config.data import Batching, DataConfig, Template
from ddptrain.config.model import ModelConfig
from ddptrain.config.trainer import EVAL_METRICS, TrainerConfig
from ddptrain.data.batch_cost import round_up


class Objective(str, Enum):
    sft = "sft"  # next-token cross-entropy on the trained tokens
    dpo = "dpo"  # Direct Preference Optimization on chosen / rejected pairs


class PreferenceLossType(str, Enum):
    sigmoid = "sigmoid"  # -log σ(β·m): DPO's own loss
    ipo = "ipo"  # (m - 1/(2β))², m from per-token mean log-probabilities (IPO)
    hinge = "hinge"  # max(0, 1 - β·m) (SLiC)


class Reference(str, Enum):
    adapter_off = "adapter_off"  # the policy's own base with its LoRA adapter switched off, without gradients
    precomputed = "precomputed"  # the base's log-probabilities computed once before training, cached with the data


@dataclass
class ObjectiveConfig:
    name: Objective = Objective.sft
    """sft: next-token loss (every data.template but preference). dpo: preference pairs (data.template=preference)."""
    beta: float = 0.1
    """dpo: β, how far the policy may move from the reference (the rewards are β × the log-probability ratios)."""
    loss_type: PreferenceLossType = PreferenceLossType.sigmoid
    """dpo: sigmoid (DPO), ipo or hinge, of the margin m = (chosen - rejected log-ratio against the reference)."""
    reference: Reference = Reference.adapter_off
    """dpo: the reference model. adapter_off: the same base with the adapter switched off, run beside the policy at
    every step (model.lora=true). precomputed: the base's reply log-probabilities computed once before the first step
    (each rank its share of the pairs), cached beside the tokenized data for the next run of the same data and base
    model; no reference forward in the step, and a full fine-tune (model.lora=false) can train."""
    sft_weight: float = 0.0
    """dpo: adds this times the chosen reply's mean token loss to each pair's loss (0 = pure preference loss)."""


# What an evaluation measures under each objective (trainer.best_metric picks one).
MEASURED = {
    Objective.sft: ("eval_loss", "eval_perplexity", "eval_accuracy"),
    Objective.dpo: ("eval_loss", "eval_rewards_accuracy"),
}


def _check_objective(o: ObjectiveConfig, d: DataConfig, m: ModelConfig, t: TrainerConfig) -> list[str]:
    problems = []
    if t.best_metric in EVAL_METRICS and t.best_metric not in MEASURED[o.name]:
        problems.append(
            f"trainer.best_metric={t.best_metric} is not measured under objective={o.name.value}: use one of "
            f"{', '.join(MEASURED[o.name])}."
        )
    if o.name == Objective.sft:
        if d.template == Template.preference or any(s.template == Template.preference for s in d.sources):
            problems.append(
                "data.template=preference holds chosen/rejected pairs, which objective=sft cannot train: set "
                "objective=dpo, or pick another data.template."
            )
        return problems
    if o.beta <= 0:
        problems.append(f"objective.beta={o.beta} must be positive (DPO's usual value is 0.1).")
    if o.sft_weight < 0:
        problems.append(f"objective.sft_weight={o.sft_weight} must be 0 (off) or positive.")
    if not d.sources and d.template != Template.preference:
        problems.append(
            "objective=dpo trains on pairs: set data.template=preference (rows with prompt, chosen and rejected)."
        )
    others = [str(k) for k, s in enumerate(d.sources) if (s.template or d.template) != Template.preference]
    if others:
        problems.append(
            f"objective=dpo trains on pairs, but data.sources {', '.join(others)} are not: set "
            "data.template=preference for every source, or data.sources[k].template=preference on each."
        )
    pair = 2 * round_up(d.max_length, max(d.pad_to_multiple_of, 1))  # a pair at data.max_length: two sequences
    if d.batching == Batching.token_budget and d.max_tokens_per_batch < pair:
        problems.append(
            f"data.max_tokens_per_batch={d.max_tokens_per_batch} cannot hold a pair at data.max_length="
            f"{d.max_length} (two sequences: {pair} tokens): raise data.max_tokens_per_batch or lower data.max_length."
        )
    if d.batching == Batching.packed:
        problems.append(
            "objective=dpo keeps each pair's two sequences apart: use data.batching=length_grouped, random or "
            "token_budget, not packed."
        )
    if not m.lora and o.reference == Reference.adapter_off:
        problems.append(
            "objective.reference=adapter_off is the base without the adapter, so it needs model.lora=true: for a "
            "full fine-tune set objective.reference=precomputed (the base's log-probabilities, computed before "
            "training)."
        )
    if t.compile:
        problems.append("objective=dpo does not compile yet: set trainer.compile=false.")
    return problems
