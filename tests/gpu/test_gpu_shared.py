"""Two ranks on one GPU over gloo: the DDP path of a GPU run, proven where only one GPU is lent.

NCCL refuses two ranks on one device ("Duplicate GPU detected"); gloo all-reduces CUDA tensors through the host, so
``parallel.backend=gloo`` puts both ranks of ``parallel=ddp2`` on cuda:0 (``parallel.cuda_index``, with a warning:
for tests, not speed). What runs on the GPU is what a real job runs there: DDP's hooks and buckets on CUDA gradients,
bf16 autocast, the save check's host copy of the base, generation on the device. Only the transport differs from a
multi-GPU node (test_gpu_ddp.py covers NCCL). Run by ``make gpu-check`` (scripts/gpu_check.py, tier "2 ranks on one
GPU").

One 2-rank run is shared by the tests that read it: accumulation (one all-reduce per optimizer step), gradient
checkpointing, two evaluations with samples, a save every 10 steps, each checked in full on the host
(``trainer.save_check=full``). A second run resumes it from the middle; a third compiles the model under DDP.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from tests.gpu.runs import assert_trains, eval_losses_at, resumed_from_step_10, train_watching_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STEPS = 20
PROMPTS = ["Sort 3, 1, 2.", "Spell the word 'ocean' letter by letter.", "Name a colour."]
ON_CUDA_0 = [
    "parallel=ddp2",
    "parallel.backend=gloo",
    "trainer.device=cuda",
    f"trainer.max_steps={STEPS}",
    "trainer.log_every_n_steps=5",
    "trainer.progress_bar=false",
    "data.max_rows=1000",
    "data.micro_batch_size=8",
    "optim.grad_accum_steps=2",
    "model.gradient_checkpointing=true",
]
# Eager attention: sdpa's fused backward adds into the query gradient with atomics, so two runs of the same steps
# may differ in the last bits, and the resume must be bit-identical (a 2-rank sum is a + b on either rank).
SHARED = [
    *ON_CUDA_0,
    "model.attn_implementation=eager",
    "data.eval_fraction=0.05",
    "trainer.eval_every_n_steps=10",
    "trainer.save_every_n_steps=10",
    "trainer.save_check=full",
    f"trainer.eval_prompts=[{','.join(repr(p) for p in PROMPTS)}]",
    "trainer.eval_max_new_tokens=8",
]


@pytest.fixture(scope="module", autouse=True)
def one_gpu_visible():
    """Every run of this module sees one GPU, whatever the machine has: with two, rank 1 would take its own."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip() or "0"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", first)
        yield


@pytest.fixture(scope="module")
def shared_run(one_gpu_visible, tmp_path_factory) -> tuple[Path, list[dict], dict]:
    out = tmp_path_factory.mktemp("shared-gpu")
    return train_watching_gpus([*SHARED, f"trainer.output_dir={out}"])


def samples_by_step(run_dir: Path) -> dict[int, list[tuple[str, str]]]:
    """``samples.jsonl`` by step: (prompt, completion) in prompt order."""
    by_step: dict[int, list[tuple[str, str]]] = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(row["step"], []).append((row["prompt"], row["completion"]))
    return by_step


def test_both_ranks_share_cuda_0_over_gloo(shared_run) -> None:
    run_dir, _, ranks = shared_run
    assert "rank 0 of 2 on cuda:0 (gloo)" in (run_dir / "train.log").read_text()
    if not ranks:
        pytest.skip("nvidia-smi lists no process of this run (a container without the host's process ids)")
    assert len(ranks) >= 2 and len(set().union(*ranks.values())) == 1, f"nvidia-smi saw {ranks}"


def test_accumulation_syncs_once_per_optimizer_step(shared_run) -> None:
    _, records, _ = shared_run
    assert_trains(records, STEPS)
    train = [r for r in records if "loss" in r]
    assert all(r["allreduce_syncs_per_step"] == 1.0 for r in train), [r["allreduce_syncs_per_step"] for r in train]
    assert all(r["allreduce_calls_per_step"] >= 1 for r in train), [r["allreduce_calls_per_step"] for r in train]


def test_eval_and_samples_run_on_both_ranks(shared_run) -> None:
    run_dir, records, _ = shared_run
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [10, 20] and all(math.isfinite(r["eval_loss"]) for r in evals), evals
    samples = samples_by_step(run_dir)
    assert sorted(samples) == [10, 20], "samples at every evaluation"
    for rows in samples.values():
        assert [prompt for prompt, _ in rows] == PROMPTS
    # What a random-init model writes is not the point (it may stop at once): each row says how many tokens and why.
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        assert 1 <= row["tokens"] <= 8 and (row["ended"] == "max_new_tokens") == (row["tokens"] == 8), row


def test_every_save_is_written_and_checked_in_full_on_the_host(shared_run) -> None:
    """trainer.save_check=full on a GPU run: every save read back and loaded in plain peft on the host, whose copy
    of the base is kept from one check to the next (host memory allowing: a GPU node has plenty for the tiny model)."""
    run_dir, records, _ = shared_run
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert saved == ["step-00000010", "step-00000020"], saved
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
    # A check that finds a difference fails its save, and so the run: here, that each save was checked, and how.
    checks = [r for r in records if "save_check_s" in r]
    assert sorted({r["step"] for r in checks}) == [10, 20], checks  # step 10; step 20 and adapter/
    assert all(r.get("save_check_round_trip") for r in checks), "full: the round trip at every save"
    assert [r["save_check_base_kept"] for r in checks] == [0] + [1] * (len(checks) - 1), "the base loaded once"


def test_resume_from_the_middle_is_bit_identical(shared_run, tmp_path) -> None:
    run_dir, records, _ = shared_run
    resumed_dir, resumed = resumed_from_step_10(SHARED, run_dir, records, tmp_path)
    final_eval = eval_losses_at(STEPS, resumed, records)
    assert final_eval[0] == final_eval[1], final_eval
    assert samples_by_step(resumed_dir)[STEPS] == samples_by_step(run_dir)[STEPS], "greedy samples of the same weights"


def test_compile_under_ddp_with_accumulation_and_checkpointing(tmp_path) -> None:
    _, records, _ = train_watching_gpus(
        [*ON_CUDA_0, "trainer.compile=true", "data.eval_fraction=0", "trainer.save_final=false",
         f"trainer.output_dir={tmp_path}"]
    )  # fmt: skip
    assert_trains(records, STEPS)
    train = [r for r in records if "loss" in r]
    assert all(r["allreduce_syncs_per_step"] == 1.0 for r in train), [r["allreduce_syncs_per_step"] for r in train]
