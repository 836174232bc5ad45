"""Each kind of local source (a glob of files, a Hub-layout folder, a .csv file) trains the default job's 2 ranks."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import datasets
import pytest

from ddptrain.config import ASSETS_DIR
from tests.conftest import read_metrics, train_in_process


def write_source(kind: str, folder: Path) -> str:
    """The first 400 bundled rows as a glob of two .jsonl files, a Hub-layout folder, or one .csv file."""
    lines = (ASSETS_DIR / "tiny_instruct.jsonl").read_text().splitlines(keepends=True)[:400]
    folder.mkdir()
    if kind == "glob":
        (folder / "half-1.jsonl").write_text("".join(lines[:200]))
        (folder / "half-2.jsonl").write_text("".join(lines[200:]))
        shutil.copy(ASSETS_DIR / "tiny_instruct.jsonl", folder / "ignored.json")  # not matched by *.jsonl
        return f"{folder}/*.jsonl"
    rows = [json.loads(line) for line in lines]
    if kind == "hub-folder":
        (folder / "data").mkdir()
        datasets.Dataset.from_list(rows).to_parquet(str(folder / "data" / "train-00000-of-00001.parquet"))
        return str(folder)
    with (folder / "rows.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["instruction", "input", "output"])
        writer.writeheader()
        writer.writerows(rows)
    return str(folder / "rows.csv")


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["glob", "hub-folder", "csv"])
def test_a_glob_a_hub_layout_folder_and_a_csv_file_each_train_two_ranks(tmp_path, datasets_cache, kind) -> None:
    source = write_source(kind, tmp_path / "data")
    run_dir = train_in_process(  # the trainer's own worker on the default job's 2 ranks (parallel=ddp2)
        tmp_path / "run",
        [
            f"data.path={source}",
            "data.eval_fraction=0",
            f"data.cache_dir={datasets_cache}",
            "trainer.max_steps=10",
            "trainer.log_every_n_steps=5",
            "trainer.progress_bar=false",
            "trainer.save_final=false",
            "parallel.timeout_s=60",
        ],
    )
    log = (run_dir / "train.log").read_text()
    assert "rank 0 of 2 on " in log
    assert f"data: 400 training rows, 0 eval rows from {source}" in log
    train = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in train] == [5, 10]
    assert all(r["tokens"] > 0 for r in train)
