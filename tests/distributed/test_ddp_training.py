"""Two gloo ranks running the real Trainer: replicas stay identical, LoRA trains, data is sharded right,
and the saved adapter reproduces the trained model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from ddptrain.launch import launch
from tests.conftest import ALPACA, compose_config, requires_shared
from tests.distributed.workers import train_and_record

pytestmark = [pytest.mark.dist, requires_shared]


def alpaca_config(tmp_path: Path, datasets_cache: Path, extra: list[str]):
    """2 gloo ranks on the first 400 Alpaca rows, every step logged."""
    return compose_config(
        [
            "parallel=ddp2",
            "parallel.timeout_s=60",
            "data=alpaca",
            f"data.path={ALPACA}",
            "data.max_rows=400",
            "data.eval_fraction=0",
            "data.max_length=256",
            f"data.cache_dir={datasets_cache}",
            "trainer.max_steps=4",
            "trainer.log_every_n_steps=1",
            "trainer.progress_bar=false",
            f"trainer.output_dir={tmp_path}",
            *extra,
        ]
    )


def run_two_ranks(tmp_path: Path, datasets_cache: Path, extra: list[str]) -> tuple[Path, list[dict]]:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    launch(alpaca_config(tmp_path, datasets_cache, extra), run_dir, entrypoint=train_and_record)
    return run_dir, [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "grad-checkpointing"])
def test_replicas_identical_and_every_lora_param_trains(tmp_path, datasets_cache, checkpointing) -> None:
    run_dir, ranks = run_two_ranks(tmp_path, datasets_cache, [f"model.gradient_checkpointing={checkpointing}"])
    rank0, rank1 = ranks
    assert len(rank0["digests"]) == 4
    for step, (a, b) in enumerate(zip(rank0["digests"], rank1["digests"]), start=1):
        assert a == b, f"trainable parameters differ between ranks after step {step}"
    lora_b = [n for n in rank0["trainable"] if "lora_B" in n]
    assert lora_b and set(lora_b) <= set(rank0["nonzero_grads"][0]), "every lora_B gets a gradient at step 1"
    within_two_steps = set(rank0["nonzero_grads"][0]) | set(rank0["nonzero_grads"][1])
    assert within_two_steps == set(rank0["trainable"]), "every LoRA parameter gets a gradient by step 2"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 4 and all(loss > 0 for loss in losses)
    # The last checkpoint read back bit for bit; adapter/ read back and loaded in peft (the last save: the round trip).
    checked = [r for r in records if "save_check_s" in r]
    assert [r["step"] for r in checked] == [4, 4] and all(r["save_check_tensors"] > 0 for r in checked)
    assert ["save_check_round_trip" in r for r in checked] == [False, True]
    assert checked[1]["save_check_max_abs_diff"] <= 1e-5


def test_each_sample_once_per_epoch_disjoint_and_reshuffled(tmp_path, datasets_cache) -> None:
    _, (rank0, rank1) = run_two_ranks(tmp_path, datasets_cache, ["trainer.max_steps=1", "data.batching=random"])
    for epoch in ("0", "1"):
        a, b = rank0["epochs"][epoch], rank1["epochs"][epoch]
        assert not set(a) & set(b), "the two ranks' shares overlap"
        seen = a + b
        assert len(seen) == len(set(seen)), "a sample appears twice in one epoch"
        assert len(seen) + rank0["dropped"] == rank0["dataset_size"]
        assert rank0["dropped"] < 2 * 8, "the documented tail is less than one global micro-step"
    assert rank0["epochs"]["0"] != rank0["epochs"]["1"], "epoch 2 must not repeat epoch 1's order"


def test_saved_adapter_reproduces_the_trained_logits(tmp_path, datasets_cache) -> None:
    run_dir, _ = run_two_ranks(tmp_path, datasets_cache, [])
    probe = torch.load(run_dir / "probe.pt")
    base = AutoModelForCausalLM.from_pretrained(run_dir / "base")
    model = PeftModel.from_pretrained(base, run_dir / "adapter").eval()
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-5, atol=1e-5)
    lora_b = {k: v for k, v in model.state_dict().items() if "lora_B" in k}
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b.values()), "the saved adapter is trained"
    assert not any(k.startswith("module.") for k in model.state_dict())


def test_a_single_node_job_listens_on_loopback_only(tmp_path) -> None:
    from tests.distributed.workers import report_listening_sockets

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # Spawned: the worker's parent is then the launcher, whose store socket the check covers too.
    overrides = ["parallel=ddp2", "parallel.start_method=spawn", "parallel.timeout_s=60"]
    overrides.append(f"trainer.output_dir={tmp_path}")
    launch(compose_config(overrides), run_dir, entrypoint=report_listening_sockets)
    for rank in (0, 1):
        addresses = json.loads((run_dir / f"listening-rank{rank}.json").read_text())
        assert addresses, "the launcher's store and gloo listen somewhere"
        assert all(a in ("127.0.0.1", "::1", "::ffff:127.0.0.1") for a in addresses), addresses
