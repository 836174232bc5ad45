"""The best evaluation so far, and when to stop: ``BestTracker`` watches ``trainer.best_metric`` at every evaluation.

Every rank holds one and feeds it the same all-reduced metrics, so every rank takes the same decisions at the same
step with no further communication: whether this evaluation is the best (the trainer then saves a checkpoint, and
the checkpointer copies its weights to ``<run>/best/``) and whether the run stops early. Its state goes into every
checkpoint, so a resumed or restarted run keeps the same best and the same count of evaluations without improvement.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ddptrain.config import EVAL_METRICS, TrainerConfig


@dataclass(frozen=True)
class BestRule:
    """What "best" means: the metric, its direction, and how many of the best checkpoints to keep."""

    metric: str = "eval_loss"
    greater_is_better: bool = False
    keep_best_n: int = 1

    @classmethod
    def build(cls, metric: str, greater_is_better: bool | None, keep_best_n: int) -> BestRule:
        """From ``trainer.best_metric``, ``.greater_is_better`` (null: the metric's own direction), ``.keep_best_n``."""
        direction = EVAL_METRICS[metric] if greater_is_better is None else greater_is_better
        return cls(metric, direction, keep_best_n)

    def gain(self, value: float, best: float | None) -> float:
        """How much better ``value`` is than ``best`` in the metric's better direction (inf when there is no best yet,
        -inf for a NaN: a diverged evaluation is never an improvement)."""
        if math.isnan(value):
            return -math.inf
        if best is None:
            return math.inf
        return value - best if self.greater_is_better else best - value

    def best_first(self, scored: list[tuple[float, Any]]) -> list[Any]:
        """The items of ``(value, item)`` pairs, best first (NaN last)."""
        ordered = sorted(
            scored, key=lambda pair: (math.isnan(pair[0]), -pair[0] if self.greater_is_better else pair[0])
        )
        return [item for _, item in ordered]


@dataclass
class BestTracker:
    """The best evaluation so far and the evaluations since the last improvement; a ``Stateful`` checkpoint part.

    Args:
        rule: the metric and its direction.
        patience: ``trainer.early_stopping.patience`` (0: never stop).
        min_delta: ``trainer.early_stopping.min_delta``.
    """

    rule: BestRule
    patience: int = 0
    min_delta: float = 0.0
    best_value: float | None = None
    best_step: int | None = None
    evals_without_improvement: int = 0
    evaluated: dict[str, Any] = field(default_factory=dict)
    """The last evaluation: its step and metrics (a checkpoint of that step records them in its manifest)."""

    def observe(self, step: int, metrics: dict[str, float]) -> bool:
        """Book the evaluation of ``step``; whether it is the best so far.

        Any gain makes it the best; only a gain of at least ``min_delta`` resets the early-stopping count.
        """
        value = float(metrics[self.rule.metric])
        gain = self.rule.gain(value, self.best_value)
        self.evaluated = {**{k: v for k, v in metrics.items() if isinstance(v, (int, float))}, "step": step}
        if gain > 0:
            self.best_value, self.best_step = value, step
        self.evals_without_improvement = (
            0 if gain > 0 and gain >= self.min_delta else self.evals_without_improvement + 1
        )
        return self.best_step == step

    @property
    def should_stop(self) -> bool:
        """``patience`` evaluations in a row brought no improvement of at least ``min_delta``."""
        return self.patience > 0 and self.evals_without_improvement >= self.patience

    def wants_checkpoint(self, step: int) -> bool:
        """The evaluation of ``step`` is the new best and best checkpoints are kept: save it now."""
        return self.rule.keep_best_n > 0 and self.best_step == step and self.evaluated.get("step") == step

    def evaluated_at(self, step: int) -> dict[str, Any] | None:
        """The metrics of the evaluation of ``step``, or None when ``step`` was not evaluated."""
        return self.evaluated if self.evaluated.get("step") == step else None

    def best_so_far(self) -> str:
        """``best 2.3456 at step 20``, or that no evaluation gave a number yet (every one NaN)."""
        if self.best_step is None:
            return f"no evaluation gave a number yet ({self.rule.metric} NaN)"
        return f"best {self.best_value:.4f} at step {self.best_step}"

    def stop_reason(self) -> str:
        """The early stop, in one line (the best step and value; where its weights are, the trainer adds)."""
        delta = f" by at least {self.min_delta:g}" if self.min_delta else ""
        best = self.best_so_far().replace("best", "the best was", 1) if self.best_step is not None else None
        return (
            f"{self.rule.metric} has not improved{delta} for {self.evals_without_improvement} evaluation(s) "
            f"(trainer.early_stopping.patience={self.patience}); {best or self.best_so_far()}"
        )

    def summary(self) -> dict[str, Any]:
        """What the run's result says of the best evaluation (``best_step``, ``best_metric``, ``best_value``) and of an
        early stop (``early_stopped``: why); empty before any evaluation."""
        stopped = {"early_stopped": self.stop_reason()} if self.should_stop else {}
        if self.best_step is None:
            return stopped
        found = {"best_step": self.best_step, "best_metric": self.rule.metric, "best_value": self.best_value}
        return found | stopped

    def state_dict(self) -> dict[str, Any]:
        state = asdict(self)
        state.pop("rule")
        return {**state, "metric": self.rule.metric}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("metric", self.rule.metric) != self.rule.metric:
            return  # another metric ranks this run now: its best so far is not comparable, start afresh
        self.best_value, self.best_step = state["best_value"], state["best_step"]
        self.evals_without_improvement = int(state["evals_without_improvement"])
        self.evaluated = dict(state["evaluated"])


def build_best_tracker(cfg: TrainerConfig, has_eval: bool) -> BestTracker:
    """The tracker of ``trainer.best_metric`` (``keep_best_n``, ``greater_is_better``, ``early_stopping.*``).

    Raises:
        ValueError: early stopping asked for a run without an eval split.
    """
    if cfg.early_stopping.patience > 0 and not has_eval:
        raise ValueError(
            f"trainer.early_stopping.patience={cfg.early_stopping.patience} watches {cfg.best_metric}, but this run "
            "has no eval split: set data.eval_fraction (or data.eval_path, data.eval_split), or "
            "trainer.early_stopping.patience=0."
        )
    rule = BestRule.build(cfg.best_metric, cfg.greater_is_better, cfg.keep_best_n)
    return BestTracker(rule, cfg.early_stopping.patience, cfg.early_stopping.min_delta)
