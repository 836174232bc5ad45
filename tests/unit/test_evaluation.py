"""The evaluation side on one process: the best tracker and early stopping, the eval batch plan, prompts rendered as
training renders rows, pruning by the best, and what the diagnosis reads of evaluations and checks (the save check
itself: ``test_save_check.py``)."""

from __future__ import annotations

import contextlib
import json
import logging
import math

import pytest
import torch
from safetensors.torch import load_file

from ddptrain import checkpoint, parallel
from ddptrain.config import DataConfig, Template
from ddptrain.data.encode import IGNORE_INDEX, RowEncoder
from ddptrain.data.plan import eval_batch_plan
from ddptrain.data.prompts import PromptRenderer
from ddptrain.diagnose import build_report
from ddptrain.diagnose.render import render_markdown
from ddptrain.diagnose.runs import read_metrics
from ddptrain.evaluation.best import BestRule, BestTracker
from ddptrain.evaluation.evaluator import Evaluator
from ddptrain.model import build_model, build_tokenizer
from ddptrain.trainer import Trainer
from tests.conftest import QWEN2_TOKENIZER, compose_config, requires_shared
from tests.unit.test_diagnose import make_run, rank_entry, record

# ----------------------------------------------------------------------------- the best tracker


def feed(tracker: BestTracker, values: list[float]) -> list[tuple[bool, bool]]:
    """(is the best, should stop) after each evaluation, at steps 10, 20, ..."""
    return [(tracker.observe(10 * (i + 1), {"eval_loss": v}), tracker.should_stop) for i, v in enumerate(values)]


def test_the_best_is_any_gain_but_only_min_delta_resets_the_patience() -> None:
    tracker = BestTracker(BestRule("eval_loss", greater_is_better=False), patience=2, min_delta=0.05)
    seen = feed(tracker, [5.0, 4.0, 4.5, 3.9, 3.95, 3.88])
    assert seen == [(True, False), (True, False), (False, False), (True, False), (False, False), (True, True)]
    assert (tracker.best_step, tracker.best_value) == (60, 3.88)  # a small gain is still the best adapter
    assert "has not improved by at least 0.05 for 2 evaluation(s)" in tracker.stop_reason()


def test_a_diverged_evaluation_is_never_the_best_and_accuracy_counts_upwards() -> None:
    losses = BestTracker(BestRule("eval_loss", greater_is_better=False), patience=1)
    assert feed(losses, [2.0, math.nan]) == [(True, False), (False, True)]
    accuracy = BestTracker(BestRule.build("eval_accuracy", None, keep_best_n=1))
    for step, value in ((1, 0.1), (2, 0.3), (3, 0.2)):
        accuracy.observe(step, {"eval_accuracy": value})
    assert accuracy.best_step == 2 and accuracy.rule.greater_is_better


def test_the_tracker_resumes_where_it_was_and_a_new_metric_starts_afresh() -> None:
    tracker = BestTracker(BestRule("eval_loss"), patience=3)
    feed(tracker, [3.0, 2.0, 2.5])
    resumed = BestTracker(BestRule("eval_loss"), patience=3)
    resumed.load_state_dict(json.loads(json.dumps(tracker.state_dict())))  # as a checkpoint keeps it
    assert (resumed.best_step, resumed.best_value, resumed.evals_without_improvement) == (20, 2.0, 1)
    assert resumed.evaluated_at(30) == {"eval_loss": 2.5, "step": 30} and resumed.evaluated_at(20) is None
    other = BestTracker(BestRule("eval_accuracy", greater_is_better=True))
    other.load_state_dict(tracker.state_dict())
    assert other.best_step is None


# ----------------------------------------------------------------------------- the eval batches


def test_every_eval_row_is_on_one_rank_in_the_same_batches_whatever_the_ranks() -> None:
    lengths = [(i * 37) % 101 + 1 for i in range(45)]  # odd-sized
    one = eval_batch_plan(lengths, micro_batch_size=4, world_size=1)[0]
    two = eval_batch_plan(lengths, micro_batch_size=4, world_size=2)
    assert sorted(i for rank in two for batch in rank for i in batch) == list(range(45))
    assert sorted(map(tuple, one)) == sorted(tuple(b) for rank in two for b in rank)  # the same batches
    padded = [sum(len(b) * max(lengths[i] for i in b) for b in rank) for rank in two]
    assert max(padded) <= 1.05 * min(padded), f"the ranks' padded tokens {padded}"  # dealt round-robin: 7% apart


# ----------------------------------------------------------------------------- prompts


def first_target(ids: list[int], labels: list[int]) -> list[int]:
    return ids[: next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)]


def test_an_alpaca_prompt_is_the_tokens_training_puts_before_the_response() -> None:
    cfg = compose_config([])
    tokenizer = build_tokenizer(cfg.model)
    renderer = PromptRenderer(cfg.data, tokenizer)
    row = {"instruction": "Sort these numbers.", "input": "3, 1, 2", "output": "1, 2, 3"}
    ((ids, labels, _),) = RowEncoder(cfg.data, tokenizer).encode([RowEncoder(cfg.data, tokenizer).turns(row)])
    assert renderer.ids({"instruction": row["instruction"], "input": row["input"]}) == first_target(ids, labels)
    plain = {"instruction": "Sort these numbers.", "input": "", "output": "x"}
    ((ids, labels, _),) = RowEncoder(cfg.data, tokenizer).encode([RowEncoder(cfg.data, tokenizer).turns(plain)])
    assert renderer.ids("Sort these numbers.") == first_target(ids, labels)


@requires_shared
def test_a_chat_prompt_ends_with_the_templates_generation_prompt() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(QWEN2_TOKENIZER)
    cfg = DataConfig(path="unused.jsonl", template=Template.chat)
    row = {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]}
    encoder = RowEncoder(cfg, tokenizer)
    ((ids, labels, _),) = encoder.encode([encoder.turns(row)])
    renderer = PromptRenderer(cfg, tokenizer)
    assert renderer.ids(row) == first_target(ids, labels)  # the reply to write is left out
    assert renderer.ids("Name a colour.") == first_target(ids, labels)
    assert renderer.text("Name a colour.").endswith("<|im_start|>assistant\n")


TINY = ["data.max_rows=64", "data.eval_fraction=0", "trainer.progress_bar=false", "parallel=single"]


@pytest.fixture(scope="module")
def trained_lora():
    """The bundled model with LoRA and its tokenizer (the save check's tests: ``test_save_check.py``)."""
    cfg = compose_config([])
    return cfg, build_model(cfg.model, seed=0, device=torch.device("cpu")).model, build_tokenizer(cfg.model)


# ----------------------------------------------------------------------------- what the diagnosis reads


def test_evaluations_and_save_checks_show_apart_from_the_steps_and_break_no_history(tmp_path) -> None:
    ranks = [rank_entry(0), rank_entry(1)]
    check = {"step": 10, "save_check_s": 0.5, "save_check_max_abs_diff": 0.0, "save_check_merged_max_abs_diff": 0.0}
    evals = [
        {"step": 10, "eval_loss": 2.5, "eval_accuracy": 0.2, "eval_s": 1.5, "samples_s": 0.25},
        {"step": 20, "eval_loss": 2.8, "eval_accuracy": 0.3, "eval_s": 1.5, "samples_s": 0.25},
    ]
    records = [record(5, ranks), record(10, ranks), check, record(15, ranks), record(20, ranks)]
    run = make_run(tmp_path / "run", records, evals=evals)
    train, read_evals = read_metrics(run)
    assert [r["step"] for r in train] == [5, 10, 15, 20] and all("loss" in r for r in train)
    assert [r["first_window"] for r in train] == [True, False, False, False], "a save's record is not a restart"
    assert [e["step"] for e in read_evals] == [10, 20]
    report = build_report(run)
    assert report["summary"]["best_step"] == 10 and report["summary"]["best_value"] == 2.5  # not the last
    markdown = render_markdown(report)
    assert "| evaluation | 2 | 3.00 | 1.50 |" in markdown
    assert "| samples (trainer.eval_prompts) | 2 | 0.50 | 0.25 |" in markdown
    assert "| save checks | 1 | 0.50 | 0.50 |" in markdown
    assert "best eval_loss 2.5000 at step 10" in markdown


def test_a_run_resumed_into_another_folder_keeps_the_best_it_resumed_from(tmp_path) -> None:
    """A run resumed after its best step from another run's checkpoint (trainer.resume=<run>) starts a new folder:
    the best so far, its step and its adapter (not the last step's), come along, and the early-stopping count with
    them."""
    # A best that is not the last, by design: the eval loss falls from step to step (the tiny model at its own
    # learning rate learns by far more per step than any CPU's rounding), and trainer.greater_is_better=true ranks
    # the highest first, so the first evaluation (step 1) is the best and every later one is not.
    inverted = ["trainer.greater_is_better=true", "optim.scheduler=constant", "optim.warmup_steps=0"]
    evaluated = [*TINY, "data.max_rows=96", "data.eval_fraction=0.2", "trainer.eval_every_n_steps=1", *inverted]
    cfg = compose_config([*evaluated, "trainer.max_steps=7", "trainer.early_stopping.patience=10"])
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device)
    try:
        first = Trainer(cfg, env, tmp_path / "first")
        first.fit()
        resumed_cfg = compose_config([*evaluated, "trainer.max_steps=8", f"trainer.resume={tmp_path / 'first'}"])
        resumed = Trainer(resumed_cfg, env, tmp_path / "second")
        named = json.loads((tmp_path / "first" / "best" / "best.json").read_text())
        assert named["step"] == 1 and first.best.evals_without_improvement == 6, "the eval loss did not fall"
        assert (resumed.step, resumed.best.best_step, resumed.best.best_value) == (7, named["step"], named["eval_loss"])
        assert resumed.best.evals_without_improvement == first.best.evals_without_improvement
        assert json.loads((tmp_path / "second" / "best" / "best.json").read_text()) == named
        resumed.fit()  # one more step and evaluation: a lower eval loss, no better by the inverted rule
    finally:
        parallel.teardown()
    _, second = read_metrics(tmp_path / "second")
    assert [r["step"] for r in second] == [8] and second[0]["eval_loss"] < named["eval_loss"]
    assert json.loads((tmp_path / "second" / "best" / "best.json").read_text()) == named, "the old best still wins"
    assert resumed.best.evals_without_improvement == first.best.evals_without_improvement + 1
    copied, source, last = (
        load_file(str(p / "adapter_model.safetensors"))
        for p in (tmp_path / "second" / "best", tmp_path / "first" / "best", tmp_path / "first" / "adapter")
    )
    assert all(torch.equal(copied[k], source[k]) for k in source)
    assert not all(torch.equal(copied[k], last[k]) for k in last), "best/ holds the last step's adapter"


def test_pruning_keeps_the_best_by_the_metrics_direction_and_the_newest(tmp_path, trained_lora) -> None:
    """keep_last_n=1, keep_best_n=2 by eval_accuracy (greater is better): the two most accurate and the newest stay,
    whatever order they came in, read back from the manifests."""
    cfg, model, tokenizer = trained_lora
    rule = BestRule.build("eval_accuracy", None, keep_best_n=2)
    files = checkpoint.AdapterFiles(tokenizer, cfg.model, seed=0)
    writer = checkpoint.CheckpointWriter(tmp_path, keep_last_n=1, files=files, rule=rule)
    for step, accuracy in ((1, 0.30), (2, 0.10), (3, 0.50), (4, 0.20), (5, 0.05)):
        meta = {"step": step, "epoch": 0, "position": step, "eval": {"eval_accuracy": accuracy, "step": step}}
        writer.save(model, {"step": step}, meta)
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert kept == ["step-00000001", "step-00000003", "step-00000005"]


def test_an_evaluation_that_gives_no_number_is_logged_and_counts_against_patience(caplog) -> None:
    tracker = BestTracker(BestRule("eval_loss"), patience=1)
    evaluator = Evaluator(None, None, None, tracker, None, None, contextlib.nullcontext, torch.device("cpu"), None)
    with caplog.at_level(logging.INFO, logger="ddptrain.trainer"):
        evaluator._book(4, {"eval_loss": math.nan, "eval_perplexity": math.nan, "eval_accuracy": math.nan})
    assert "no evaluation gave a number yet" in caplog.text and tracker.should_stop
    assert tracker.summary() == {"early_stopped": tracker.stop_reason()}
