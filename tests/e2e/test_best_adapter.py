"""Picking the winner, through the real CLI on 2 CPU ranks: a run whose best evaluation is not its last keeps the best
adapter and names it, stops early on both ranks at the same step with a checkpoint and exit code 0, and its best
adapter, evaluated again on one rank, gives the eval loss the two ranks logged for that step.

The best is not the last by design, not by pushing the learning rate until the loss turns (a trajectory that differs
from one CPU's kernels to the next): the eval loss falls at every evaluation (the tiny model at its own learning rate
learns by far more per step than any rounding), and trainer.greater_is_better=true ranks the highest loss best, so
the first evaluation is the best and the run stops PATIENCE evaluations later."""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from ddptrain import checkpoint, parallel
from ddptrain.data import build_training_data
from ddptrain.evaluation.metrics import evaluate
from ddptrain.model import build_model, build_tokenizer
from tests.conftest import assert_no_process_left, compose_config, read_metrics, run_ddptrain, run_dirs

pytestmark = pytest.mark.e2e

PATIENCE, EVERY = 2, 2
DATA = ["data.max_rows=810", "data.eval_fraction=0.05"]  # 41 eval rows: odd, and not a multiple of 2 ranks x 8
ARGS = [
    *DATA,
    "trainer.max_steps=40",
    f"trainer.eval_every_n_steps={EVERY}",
    f"trainer.log_every_n_steps={EVERY}",
    "trainer.keep_last_n=1",
    "trainer.keep_best_n=1",
    f"trainer.early_stopping.patience={PATIENCE}",
    "trainer.greater_is_better=true",  # the first evaluation is the best: the eval loss falls (module docstring)
    "trainer.progress_bar=false",
    "parallel.timeout_s=60",
]


@pytest.fixture(scope="module")
def early_stopped(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("best") / f"run-{uuid.uuid4().hex}"
    result = run_ddptrain([*ARGS, f"trainer.output_dir={out}"], timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_no_process_left(out.name)
    (run_dir,) = run_dirs(out)
    return run_dir, result.stderr


def eval_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in read_metrics(run_dir) if "eval_loss" in r}


def test_the_run_stops_when_eval_stops_improving_keeping_the_best_adapter(early_stopped) -> None:
    run_dir, output = early_stopped
    losses = eval_losses(run_dir)
    steps = sorted(losses)
    best = max(steps, key=lambda s: (losses[s], -s))
    stop = steps[-1]
    assert best == EVERY, f"the eval loss did not fall from the first evaluation on: {losses}"
    assert stop == best + PATIENCE * EVERY and losses[stop] < losses[best], losses  # patience evaluations later
    assert steps == list(range(EVERY, stop + 1, EVERY)), "an evaluation every 2 steps, none after the stop"

    # The best checkpoint outlived trainer.keep_last_n=1; the stop saved one of its own; nothing else is kept.
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert kept == [f"step-{best:08d}", f"step-{stop:08d}"]
    final = json.loads((run_dir / "checkpoints" / f"step-{stop:08d}" / checkpoint.MANIFEST).read_text())
    state = checkpoint.load_state(run_dir / "checkpoints" / f"step-{stop:08d}")
    assert final["step"] == stop and len(state["windows"]) == 2, "both ranks saved at the step the run stopped"
    assert state["best"]["best_step"] == best and state["best"]["evals_without_improvement"] == PATIENCE

    # best/ holds that checkpoint's adapter, bit for bit, and names it.
    named = json.loads((run_dir / "best" / "best.json").read_text())
    assert (named["step"], named["eval_loss"]) == (best, losses[best])
    best_weights = load_file(str(run_dir / "best" / "adapter_model.safetensors"))
    at_best = load_file(str(run_dir / "checkpoints" / f"step-{best:08d}" / "weights" / "adapter_model.safetensors"))
    at_stop = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    assert best_weights.keys() == at_best.keys()
    assert all(torch.equal(best_weights[k], at_best[k]) for k in at_best)
    assert not all(torch.equal(best_weights[k], at_stop[k]) for k in at_stop), "best/ is not the last adapter"

    # One line says why and where the best adapter is; the report names it.
    stopped = re.findall(r"ddptrain: stopped early at step (\d+): eval_loss has not improved", output)
    assert stopped == [str(stop)], output[-3000:]
    assert f"the best adapter (step {best}, eval_loss {losses[best]:.4f}) is in {run_dir / 'best'}" in output
    assert f"best eval_loss {losses[best]:.4f} at step {best}" in (run_dir / "report.md").read_text()


def test_the_best_adapter_evaluated_on_one_rank_gives_the_loss_two_ranks_logged(early_stopped) -> None:
    """The eval split (41 rows) cut for one rank and for two holds the same batches: the eval loss of the best
    adapter, loaded with plain peft and evaluated here on one rank, equals what the 2-rank run logged at its step,
    and so best/ holds that step's adapter."""
    run_dir, _ = early_stopped
    named = json.loads((run_dir / "best" / "best.json").read_text())
    cfg = compose_config([*DATA, "parallel=single"])
    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device)
    try:
        tokenizer = build_tokenizer(cfg.model)
        data = build_training_data(
            cfg.data, tokenizer, env, seed=cfg.trainer.seed, grad_accum_steps=1, flash_varlen=False
        )
        assert len(data.eval) % 2 == 1, "the eval split must be odd-sized"
        adapter = json.loads((run_dir / "best" / "adapter_config.json").read_text())
        base = AutoModelForCausalLM.from_pretrained(adapter["base_model_name_or_path"])
        plain = PeftModel.from_pretrained(base, run_dir / "best")  # nothing of ddptrain loads it
        loss_module = build_model(cfg.model, cfg.trainer.seed, env.device, tokenizer)
        loss_module.model.load_state_dict(plain.state_dict())  # the same tensors in the module that computes the loss
        one_rank = evaluate(loss_module, data.eval_batches(), contextlib.nullcontext, env.device)
    finally:
        parallel.teardown()
    assert one_rank["eval_tokens"] == named["eval_tokens"]
    # The issue asks 1e-6; the same batches summed in float64 give float64 rounding (a rank's own shard of rows,
    # cut into batches, differed by 9e-8 here).
    assert abs(one_rank["eval_loss"] - named["eval_loss"]) <= 1e-12, (one_rank["eval_loss"], named["eval_loss"])
