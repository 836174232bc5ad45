"""Around the steps, on 2 gloo ranks: the samples' generation holds no collective (a rank generates while the other
is away), and the memory plan predicts the peak a real step and an evaluation add on each rank (issue 24)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from ddptrain.launch import launch
from tests.conftest import compose_config
from tests.distributed.workers_evaluation import (
    LATE_S,
    generate_while_the_other_rank_is_away,
    train_a_step_measuring_its_memory,
)

pytestmark = pytest.mark.dist

PROMPTS = ["Reverse the order of these words.", "Sort 3, 1, 2.", "Spell the word 'ocean' letter by letter."]
GIB = 1024**3
PAGE = 4096  # VmHWM and ru_maxrss count pages (in KiB); the report carries GiB as a float


def test_a_rank_generates_its_samples_while_the_other_rank_is_away(tmp_path) -> None:
    """Rank 1 comes to the samples' round 5 s late. Rank 0 still generates its share and reaches the round's one
    collective (the gather of the completions) before rank 1 has begun: nothing inside generation waited for it.
    Both ranks end with every prompt's completion, in prompt order."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    prompts = ",".join(repr(p) for p in PROMPTS)
    cfg = compose_config(
        [
            "parallel=ddp2",
            "parallel.timeout_s=60",
            f"trainer.eval_prompts=[{prompts}]",
            "trainer.eval_max_new_tokens=8",
            f"trainer.output_dir={tmp_path}",
        ]
    )
    launch(cfg, run_dir, entrypoint=generate_while_the_other_rank_is_away)
    first, late = (json.loads((run_dir / f"samples-rank{r}.json").read_text()) for r in (0, 1))
    assert len(first["gathers"]) == 1 and len(late["gathers"]) == 1, "one collective per round: the gather"
    assert first["gathers"][0] < late["started"], "rank 0 waited for rank 1 inside generation"
    assert late["started"] - first["started"] >= LATE_S * 0.9
    assert first["rows"] == late["rows"] and [row["prompt"] for row in first["rows"]] == PROMPTS


def text_rows(path: Path, words: list[tuple[int, int]], seed: int) -> Path:
    """Plain-text rows, one per range in ``words``, of a random number of words in it (the tiny tokenizer makes about
    2 tokens a word)."""
    vocabulary = "red blue green river stone music window garden silver paper light north quiet bridge".split()
    draw = random.Random(seed)
    texts = [" ".join(draw.choices(vocabulary, k=draw.randint(*span))) for span in words]
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return path


def five_layer_qwen2(folder: Path, vocab_size: int) -> Path:
    """The bundled tiny Qwen2 with 5 decoder layers instead of 2 and a vocabulary of ``vocab_size`` (the tokenizer's
    4,257 ids are among them): more layers than the planner simulates whole (it simulates copies cut to 2 and 3
    layers and carries the difference on), so the prediction checked is the carried-on one."""
    config = json.loads((Path(compose_config([]).model.name_or_path) / "config.json").read_text())
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 5, "vocab_size": vocab_size}))
    return folder


MICRO_BATCH = 4
LONG, SHORT = (400, 520), (120, 200)  # words: rows of about 800-1,040 tokens (cut at 1,024), and 240-400
TOLERANCE = 0.15  # what the plan claims for each rank's peak (issue 24): twice it is the least the ranks must differ
# What the report may show between each rank's plan and its measured resident peak (issue 38). The plan leaves out
# what Python objects made after the start hold (the model's modules, the optimizer, the autograd graph): 2-5%
# of these peaks, measured.
REPORTED_TOLERANCE = 0.10


def pair_rows(path: Path, words: list[tuple[int, int]], seed: int) -> Path:
    """Preference pairs (objective=dpo), one per range in ``words``: a prompt of a quarter of the range's words and
    two replies of a random number of words in it (each sequence about 2 tokens a word, cut at data.max_length)."""
    vocabulary = "red blue green river stone music window garden silver paper light north quiet bridge".split()
    draw = random.Random(seed)

    def text(low: int, high: int) -> str:
        return " ".join(draw.choices(vocabulary, k=draw.randint(low, high)))

    rows = [{"prompt": text(lo // 4, hi // 4), "chosen": text(lo, hi), "rejected": text(lo, hi)} for lo, hi in words]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


DPO = ["objective=dpo", "data.template=preference"]


@pytest.mark.parametrize(
    ("strategy", "objective"), [("ddp", []), ("fsdp2", []), ("ddp", DPO)], ids=["ddp", "fsdp2", "dpo"]
)
def test_the_plan_predicts_the_peak_a_step_and_an_evaluation_add_on_each_rank_within_15_percent(
    tmp_path, strategy, objective
) -> None:
    """A 2-rank run of a 5-layer model with a 16k vocabulary and the LM head unchunked (model.loss_chunk_tokens=0):
    its (targets x vocabulary) fp32 logits and their gradients make the transients (what the step holds beyond
    what it keeps for backward) at least 30% of each rank's predicted peak. The training set is one micro-step of
    rows by design: data.batching=length_grouped sorts it, so one rank gets the 4 long rows and the other the 4
    short ones, and the two ranks' peaks differ by more than twice the tolerance (one prediction cannot pass for
    both). Planning at start on a CPU with plan.cpu_returns_freed_memory=true, each rank hands freed memory back to
    the system, so that its resident set follows what is alive.

    The report the run writes sets each rank's plan beside its measured resident peak, which is the whole run's up
    to the step's log window (weights loaded, LoRA, DDP, the step: nothing resets it before), and they agree within
    10%: on rank 0, whose step is most of its peak, and on rank 1. Each rank's plan, made at start from the real data
    through the real sampler, predicts within 15% the peak resident memory its step adds (the step sets the run's
    new high, so the peak after it is the step's own) and the peak its evaluation adds (the costliest eval
    micro-batch, on the rank it goes to; measured with the peak reset right before, after the step's window)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    halves = [LONG] * MICRO_BATCH + [SHORT] * MICRO_BATCH
    rows = pair_rows if objective else text_rows  # objective=dpo: 4 pairs a rank, 8 sequences
    cfg = compose_config(
        [
            "parallel=ddp2",
            f"parallel.strategy={strategy}",
            f"model.name_or_path={five_layer_qwen2(tmp_path / 'five-layers', vocab_size=16384)}",
            "model.loss_chunk_tokens=0",  # the whole (targets x vocabulary) logits at once: large transients
            "parallel.timeout_s=120",
            f"data.path={rows(tmp_path / 'train.jsonl', halves, seed=0)}",
            f"data.eval_path={rows(tmp_path / 'eval.jsonl', halves, seed=1)}",
            "data.template=text",
            *objective,
            "data.max_length=1024",
            f"data.micro_batch_size={MICRO_BATCH}",
            "data.batching=length_grouped",
            "trainer.eval_every_n_steps=1",
            "trainer.max_steps=1",
            "trainer.save_final=false",
            "trainer.progress_bar=false",
            "plan.at_start=true",
            "plan.cpu_returns_freed_memory=true",  # the resident set follows the tensors alive, as planned
            f"trainer.output_dir={tmp_path}",
        ]
    )
    launch(cfg, run_dir, entrypoint=train_a_step_measuring_its_memory)
    measured = [json.loads((run_dir / f"memory-rank{rank}.json").read_text()) for rank in (0, 1)]
    # The report: each rank's plan beside the resident peak it measured, the same quantity on both sides. That peak
    # (ru_maxrss at the step's log window) is the run's: at least the peak before the step (loading, LoRA, DDP), at
    # most the peak read after the window, before the evaluation's reset (a page of rounding either side).
    by_rank = json.loads((run_dir / "report.json").read_text())["by_rank"]
    step = measured[0]["planned_activations"] + measured[0]["planned_transient"]
    assert step >= 0.5 * by_rank[0]["mem_predicted_gb"] * GIB, "rank 0's step must be most of its planned peak"
    for rank, (row, m) in enumerate(zip(by_rank, measured, strict=True)):
        reported = row["mem_peak_gb"] * GIB
        assert m["peak_before_step"] - PAGE <= reported <= m["peak_before_eval"] + PAGE, (
            f"rank {rank}: the report's peak {reported / GIB:.3f} GiB is not the run's: "
            f"{m['peak_before_step'] / GIB:.3f} GiB before the step, {m['peak_before_eval'] / GIB:.3f} after it"
        )
        error = abs(row["mem_predicted_gb"] - row["mem_peak_gb"]) / row["mem_peak_gb"]
        print(f"rank {rank}: the report sets {row['mem_predicted_gb']:.3f} GiB planned beside {row['mem_peak_gb']:.3f}")
        assert error <= REPORTED_TOLERANCE, (
            f"rank {rank}: the report sets the plan's {row['mem_predicted_gb']:.3f} GiB beside a measured "
            f"{row['mem_peak_gb']:.3f} GiB ({error:.0%} apart)"
        )
    # The step: without a reset before it, the peak after it is its own where it set the run's new high.
    for rank, m in enumerate(measured):
        assert m["peak_after_step"] > m["peak_before_step"], f"rank {rank}: the step is not the run's peak so far"
    predicted = [m["predicted_allocated"] - m["weights"] for m in measured]  # the weights were there before
    # Transients of 30% or more: a plan that left them out would miss each rank's peak by over twice the tolerance.
    for rank, m in enumerate(measured):
        share = m["planned_transient"] / (m["planned_activations"] + m["planned_transient"])
        assert share >= 0.3, f"rank {rank}: the transients are only {share:.0%} of what the step adds"
    added = [m["step_increase"] for m in measured]
    print(f"steps added {[f'{a / GIB:.3f}' for a in added]} GiB, predicted {[f'{p / GIB:.3f}' for p in predicted]}")
    assert min(added) < (1 - 2 * TOLERANCE) * max(added), f"the ranks' steps must differ by over 30%: {added}"
    for rank, (m, p) in enumerate(zip(measured, predicted, strict=True)):
        assert m["padded"] > m["tokens"], f"rank {rank}: some row must be shorter than the micro-batch's width"
        error = abs(p - m["step_increase"]) / m["step_increase"]
        assert error <= TOLERANCE, (
            f"rank {rank}: predicted {p / GIB:.3f} GiB, the step added {m['step_increase'] / GIB:.3f}"
        )
    # The evaluation: the plan's eval peak (its costliest eval micro-batch, on whichever rank it goes to) less what was
    # alive before it: the weights, and the LoRA parameters' gradients and AdamW states, which the prediction counts
    # too. The other rank's eval batch (the short rows) costs less.
    # (The eval peak also holds the resident set at start, which was there before too.)
    predicted_eval = measured[0]["predicted_eval_gb"] * GIB - measured[0]["weights"]
    predicted_eval -= measured[0]["planned_resident_at_start"]
    assert all(m["eval_padded"] > 0 for m in measured), "each rank evaluates a micro-batch"
    costliest = max(m["eval_increase"] for m in measured)
    evaluations = [round(m["eval_increase"] / GIB, 3) for m in measured]
    print(f"evaluations added {evaluations} GiB, predicted {predicted_eval / GIB:.3f}")
    assert abs(predicted_eval - costliest) / costliest <= TOLERANCE, (
        f"predicted {predicted_eval / GIB:.3f} GiB for evaluation, it added {costliest / GIB:.3f} GiB"
    )
    assert all(m["eval_increase"] <= (1 + TOLERANCE) * predicted_eval for m in measured)
