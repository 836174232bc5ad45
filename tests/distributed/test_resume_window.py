"""A run resumed in the middle of a log window logs exactly what the uninterrupted run logged."""

from __future__ import annotations

import pytest

from tests.conftest import read_metrics, train_in_process

pytestmark = pytest.mark.dist

ARGS = [
    "parallel=ddp2",
    "data.max_rows=400",
    "data.eval_fraction=0",
    "trainer.max_steps=8",
    "trainer.log_every_n_steps=4",
    "trainer.progress_bar=false",
    "parallel.timeout_s=60",
]


def test_resume_mid_window_logs_the_uninterrupted_loss(tmp_path) -> None:
    """Checkpoints at steps 2 and 6 fall inside the windows that log at steps 4 and 8: each rank's own
    part of the window must come back, not rank 0's on every rank."""
    full_dir = train_in_process(tmp_path / "full", [*ARGS, "trainer.save_every_n_steps=2", "trainer.keep_last_n=10"])
    expected = {r["step"]: r for r in read_metrics(full_dir) if "loss" in r}
    assert sorted(expected) == [4, 8]

    resume = f"trainer.resume={full_dir}/checkpoints/step-00000006"
    resumed_dir = train_in_process(tmp_path / "resumed", [*ARGS, resume])
    (record,) = [r for r in read_metrics(resumed_dir) if "loss" in r]
    assert record["step"] == 8
    for key in ("loss", "target_tokens", "tokens", "padding_fraction", "rank_imbalance", "peak_rank_tokens"):
        assert record[key] == expected[8][key], key
