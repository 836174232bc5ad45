"""Several epochs through ``fit``'s own loop on 2 gloo ranks, for every batching mode: each sample once
per epoch, a new order every epoch, and logged batch figures equal to what the loader really yielded,
also in log windows that span an epoch boundary between plans of different lengths."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from ddptrain.launch import launch
from tests.conftest import compose_config, read_metrics
from tests.distributed.workers_epochs import train_recording_batches

pytestmark = pytest.mark.dist

WORLD, MICRO_BATCH, LOG_EVERY = 2, 8, 3
# Chosen so that token_budget's and packed's plans differ in length between epochs (the test checks
# it) and a 3-step log window spans each boundary, the case that once crashed with IndexError. Rows cut at 256
# tokens cut the cost of the modes that pad to a batch's longest row (random's test: 28.5 s in the suite, then 17.6 s).
MODES = {
    "random": ["data.max_length=256"],
    "length_grouped": ["data.max_length=256"],
    "token_budget": ["data.max_tokens_per_batch=640"],
    "packed": ["data.max_tokens_per_batch=768", "trainer.seed=3"],
}


def run_epochs(tmp_path: Path, batching: str) -> tuple[list[dict], list[dict], int]:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = compose_config(
        [
            "parallel=ddp2",
            "parallel.timeout_s=60",
            "data.max_rows=300",
            "data.eval_fraction=0",
            f"data.micro_batch_size={MICRO_BATCH}",
            f"data.batching={batching}",
            "data.pad_to_multiple_of=1",
            "trainer.epochs=3",
            f"trainer.log_every_n_steps={LOG_EVERY}",
            "trainer.progress_bar=false",
            "trainer.save_final=false",
            f"trainer.output_dir={tmp_path}",
            *MODES[batching],
        ]
    )
    launch(cfg, run_dir, entrypoint=train_recording_batches)
    ranks = [json.loads((run_dir / f"batches-rank{r}.json").read_text()) for r in range(WORLD)]
    records = [r for r in read_metrics(run_dir) if "loss" in r]
    return records, [rank["batches"] for rank in ranks], ranks[0]["dataset_size"]


@pytest.mark.parametrize("batching", sorted(MODES))
def test_every_batching_mode_sees_each_sample_once_per_epoch_learns_and_logs_what_it_trained_on(
    tmp_path, batching
) -> None:
    records, per_rank, dataset_size = run_epochs(tmp_path, batching)
    # It learns: the last epoch's loss is well under the first's (the bundled rows, seen three times).
    first, last = (
        [r["loss"] for r in records if r["epoch"] == epoch] for epoch in (records[0]["epoch"], records[-1]["epoch"])
    )
    assert sum(last) / len(last) < 0.9 * sum(first) / len(first), (first, last)

    # Each rank ran the same micro-steps; every epoch covers the data once, disjointly, in a new order.
    assert [[b["step"] for b in rank] for rank in per_rank[1:]] == [[b["step"] for b in per_rank[0]]]
    epochs = defaultdict(list)
    lengths = defaultdict(int)
    for rank in per_rank:
        for batch in rank:
            epochs[batch["epoch"]].append(batch["samples"])
    for batch in per_rank[0]:
        lengths[batch["epoch"]] += 1
    assert sorted(epochs) == [0, 1, 2], "fit runs trainer.epochs=3 epochs"
    orders = {}
    for epoch, batches in epochs.items():
        seen = [i for samples in batches for i in samples]
        assert len(seen) == len(set(seen)), f"a sample appears twice in epoch {epoch}"
        if batching in ("random", "length_grouped"):
            assert len(seen) == dataset_size - dataset_size % (WORLD * MICRO_BATCH)
        else:
            assert len(seen) == dataset_size, f"epoch {epoch} left out {dataset_size - len(seen)} samples"
        orders[epoch] = seen
    assert len({tuple(order) for order in orders.values()}) == 3, "each epoch must be shuffled anew"
    if batching in ("token_budget", "packed"):
        assert len(set(lengths.values())) > 1, f"plan lengths per epoch {dict(lengths)} must differ for this test"

    # Logged figures equal the yielded batches, window by window.
    assert records[-1]["step"] == sum(lengths.values())
    start = 0
    for record in records:
        window = [b for rank in per_rank for b in rank if start < b["step"] <= record["step"]]
        real, padded = sum(b["real"] for b in window), sum(b["padded"] for b in window)
        assert record["tokens"] == real, f"step {record['step']}"
        assert record["padding_fraction"] == pytest.approx(1 - real / padded, abs=1e-12)
        assert record["peak_rank_tokens"] == max(b["padded"] for b in window)
        by_micro_step = defaultdict(list)
        for rank in per_rank:
            for k, b in enumerate(b for b in rank if start < b["step"] <= record["step"]):
                by_micro_step[k].append(b["padded"])
        worst = max(max(p) / (sum(p) / len(p)) for p in by_micro_step.values())
        assert record["rank_imbalance"] == pytest.approx(max(worst, 1.0), rel=1e-12)
        start = record["step"]
    total_real = sum(b["real"] for rank in per_rank for b in rank)
    assert sum(r["tokens"] for r in records) == total_real
    if batching == "packed":
        assert all(r["padding_fraction"] == 0.0 for r in records)
    if batching in ("token_budget", "packed"):
        budget = int(MODES[batching][0].split("=")[1])
        assert max(b["padded"] for rank in per_rank for b in rank) <= budget, "a micro-batch over the token budget"
