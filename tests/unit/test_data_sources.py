"""data.path as users keep their data: a csv file, a glob, a folder (plain, or laid out as a Hub dataset
repository), a Hub dataset id (offline here: nothing is downloaded), with data.subset and data.split."""

from __future__ import annotations

import csv
import json
import os
import re
import socket
import time
from pathlib import Path

import datasets
import huggingface_hub
import pytest

from ddptrain.config import ConfigError, DataConfig, SourceConfig
from ddptrain.data import build_datasets, load_rows, tokenize_file
from ddptrain.data.templates import alpaca_prompt
from tests.conftest import compose_config
from tests.unit import test_data
from tests.unit.test_data import ROWS, data_cfg, ids, write_jsonl

tokenizer = test_data.tokenizer  # the fixture, shared with test_data.py
ASSET_ROWS = Path(__file__).resolve().parents[2] / "ddptrain" / "assets" / "tiny_instruct.jsonl"

HUB_LAYOUT_README = """---
configs:
- config_name: default
  default: true
  data_files:
  - split: train
    path: data/train-*.parquet
  - split: test
    path: data/test-*.parquet
- config_name: short
  data_files:
  - split: train
    path: short/*.parquet
---
"""


def encoded(tokenizer, path: str, cache: Path, **cfg) -> list[list[int]]:
    """input_ids of every row read from ``path`` (data.path=path and the given data.* keys)."""
    data, _ = tokenize_file(path, data_cfg(path, cache, **cfg), tokenizer, None)
    return data["input_ids"]


def reference(tokenizer, rows: list[dict]) -> list[list[int]]:
    """input_ids of Alpaca rows, written out by hand: prompt, response, EOS."""
    return [
        ids(tokenizer, alpaca_prompt(r["instruction"], r["input"]))
        + ids(tokenizer, r["output"])
        + [tokenizer.eos_token_id]
        for r in rows
    ]


def write_parquet(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows).to_parquet(str(path))


def touch_later(path: Path) -> None:
    """Move the modification time on by a second, as an edit a second later would."""
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))


# ----------------------------------------------------------------------------- files and globs


def test_csv_file_encodes_like_the_rows(tokenizer, tmp_path, datasets_cache):
    path = tmp_path / "rows.csv"
    datasets.Dataset.from_list(ROWS).to_csv(str(path), index=False)
    assert path.read_text().startswith("instruction,input,output\n")
    assert encoded(tokenizer, str(path), datasets_cache) == reference(tokenizer, ROWS)


def test_glob_reads_every_match_in_sorted_order(tokenizer, tmp_path, datasets_cache):
    # Written in reverse order: only sorting puts part-1's rows first.
    write_jsonl(tmp_path / "part-2.jsonl", ROWS[2:])
    write_jsonl(tmp_path / "part-1.jsonl", ROWS[:2])
    (tmp_path / "notes.txt").write_text("not matched by the pattern\n")
    assert encoded(tokenizer, f"{tmp_path}/part-*.jsonl", datasets_cache) == reference(tokenizer, ROWS)


def test_bad_row_in_a_glob_names_its_own_file_and_line(tokenizer, tmp_path, datasets_cache):
    write_jsonl(tmp_path / "a.jsonl", ROWS[:2])
    second = write_jsonl(tmp_path / "b.jsonl", [ROWS[2], {"instruction": "No output here."}])
    with pytest.raises(ValueError, match=re.escape(f"{second}:2: ")):
        encoded(tokenizer, f"{tmp_path}/*.jsonl", datasets_cache)


def test_glob_errors_name_the_pattern(tmp_path, datasets_cache):
    with pytest.raises(ValueError, match=re.escape(f"data.path={tmp_path}/*.jsonl: the pattern matches no files")):
        load_rows(f"{tmp_path}/*.jsonl", str(datasets_cache))
    write_jsonl(tmp_path / "a.jsonl", ROWS)
    datasets.Dataset.from_list(ROWS).to_csv(str(tmp_path / "b.csv"), index=False)
    with pytest.raises(ValueError, match=r"files of several types \(\.csv, \.jsonl\)"):
        load_rows(f"{tmp_path}/*", str(datasets_cache))


def test_unsupported_file_type_lists_the_supported_ones(tmp_path, datasets_cache):
    path = tmp_path / "rows.txt"
    path.write_text("instruction,output\na,b\n")
    with pytest.raises(ValueError, match=r"data\.path=.*rows\.txt: unsupported file type '\.txt'; .*\.jsonl.*\.csv"):
        load_rows(str(path), str(datasets_cache))


def test_invalid_json_line_in_a_glob_names_file_and_line(tmp_path, datasets_cache):
    write_jsonl(tmp_path / "a.jsonl", ROWS)
    broken = tmp_path / "b.jsonl"
    broken.write_text(json.dumps(ROWS[0]) + '\n{"instruction": "x", "output": \n')
    with pytest.raises(ValueError, match=re.escape(f"{broken}:2: not valid JSON")):
        load_rows(f"{tmp_path}/*.jsonl", str(datasets_cache))


def test_an_edited_glob_member_is_not_served_from_a_stale_cache(tokenizer, tmp_path, datasets_cache):
    write_jsonl(tmp_path / "a.jsonl", ROWS[:2])
    second = tmp_path / "b.jsonl"
    write_jsonl(second, ROWS[2:3])
    pattern = f"{tmp_path}/*.jsonl"
    first, _ = tokenize_file(pattern, data_cfg(pattern, datasets_cache), tokenizer, None)
    assert first["input_ids"] == reference(tokenizer, ROWS[:3])

    write_jsonl(second, ROWS[3:4])
    touch_later(second)
    again, _ = tokenize_file(pattern, data_cfg(pattern, datasets_cache), tokenizer, None)
    assert again._fingerprint != first._fingerprint
    assert again["input_ids"] == reference(tokenizer, [*ROWS[:2], ROWS[3]])


# ----------------------------------------------------------------------------- folders


def test_folder_of_jsonl_files_reads_them_all(tokenizer, tmp_path, datasets_cache):
    folder = tmp_path / "rows"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", ROWS[:3])
    write_jsonl(folder / "b.jsonl", ROWS[3:])
    assert sorted(encoded(tokenizer, str(folder), datasets_cache)) == sorted(reference(tokenizer, ROWS))


def test_folder_laid_out_as_a_hub_dataset_gives_the_split_asked_for(tokenizer, tmp_path, datasets_cache):
    repo = tmp_path / "repo"
    write_parquet(repo / "data" / "train-00000-of-00001.parquet", ROWS[:3])
    write_parquet(repo / "data" / "test-00000-of-00001.parquet", ROWS[3:])
    assert encoded(tokenizer, str(repo), datasets_cache) == reference(tokenizer, ROWS[:3])
    assert encoded(tokenizer, str(repo), datasets_cache, split="test") == reference(tokenizer, ROWS[3:])
    with pytest.raises(ValueError, match=r"data\.path=.*repo: Unknown split \"validation\".*Set data\.split"):
        encoded(tokenizer, str(repo), datasets_cache, split="validation")


def test_subset_picks_a_config_of_the_dataset_card(tokenizer, tmp_path, datasets_cache):
    repo = tmp_path / "repo"
    write_parquet(repo / "data" / "train-00000-of-00001.parquet", ROWS[:3])
    write_parquet(repo / "data" / "test-00000-of-00001.parquet", ROWS[3:])
    write_parquet(repo / "short" / "train-00000-of-00001.parquet", ROWS[1:2])
    (repo / "README.md").write_text(HUB_LAYOUT_README)
    assert encoded(tokenizer, str(repo), datasets_cache) == reference(tokenizer, ROWS[:3])
    assert encoded(tokenizer, str(repo), datasets_cache, subset="short") == reference(tokenizer, ROWS[1:2])
    with pytest.raises(ValueError, match=r"'long' not found.*Set data\.subset"):
        encoded(tokenizer, str(repo), datasets_cache, subset="long")


# ----------------------------------------------------------------------------- Hub ids, offline


@pytest.fixture
def offline(monkeypatch) -> list[str]:
    """HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1, set after datasets was imported; every attempt to reach
    the network is refused and recorded."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    attempts: list[str] = []

    def refuse(*args, **kwargs):
        attempts.append(repr(args[:2]))
        raise OSError("this test is offline")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


def test_missing_hub_dataset_offline_fails_fast_naming_the_key_and_the_download(offline, tmp_path, datasets_cache):
    name = "ddptrain-tests/no-such-dataset"
    online_settings = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        load_rows(name, str(datasets_cache))
    assert time.monotonic() - start < 5
    assert offline == [], "no network call may be attempted offline"
    message = str(info.value)
    assert message.startswith(f"data.path={name}: ")
    assert "offline mode is on" in message
    assert f"hf download --repo-type dataset {name}" in message
    assert "point data.path at that folder" in message
    # The settings datasets and huggingface_hub read at import are left as they were.
    assert online_settings == (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE)


def test_hub_dataset_in_the_hub_cache_loads_offline(offline, tokenizer, tmp_path, datasets_cache, monkeypatch):
    # What `hf download --repo-type dataset owner/rows` leaves in the Hub cache.
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    storage = cache / "datasets--owner--rows"
    write_parquet(storage / "snapshots" / commit / "data" / "train-00000-of-00001.parquet", ROWS[:3])
    write_parquet(storage / "snapshots" / commit / "data" / "test-00000-of-00001.parquet", ROWS[3:])
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    assert encoded(tokenizer, "owner/rows", datasets_cache, split="test") == reference(tokenizer, ROWS[3:])
    assert offline == []


def hub_cache_with_two_revisions(cache: Path) -> tuple[str, str]:
    """What `hf download --repo-type dataset owner/rows` (main) and `... --revision v1` leave in the Hub cache: main
    holds train ROWS[:3] and test ROWS[3:], tag v1 another commit with the halves the other way round."""
    storage = cache / "datasets--owner--rows"
    commits = "0123456789abcdef0123456789abcdef01234567", "89abcdef0123456789abcdef0123456789abcdef"
    for commit, (train, test) in zip(commits, [(ROWS[:3], ROWS[3:]), (ROWS[3:], ROWS[:3])]):
        write_parquet(storage / "snapshots" / commit / "data" / "train-00000-of-00001.parquet", train)
        write_parquet(storage / "snapshots" / commit / "data" / "test-00000-of-00001.parquet", test)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commits[0])
    (storage / "refs" / "v1").write_text(commits[1])
    return commits


def test_a_hub_revision_reads_that_revision_offline_with_its_own_test_split_as_eval_set(
    offline, tokenizer, tmp_path, datasets_cache, monkeypatch
):
    main_commit, _ = hub_cache_with_two_revisions(tmp_path / "hub")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    main, v1 = reference(tokenizer, ROWS[:3]), reference(tokenizer, ROWS[3:])
    assert encoded(tokenizer, "owner/rows", datasets_cache) == main
    assert encoded(tokenizer, "owner/rows@v1", datasets_cache) == v1
    assert encoded(tokenizer, "owner/rows", datasets_cache, revision="v1") == v1
    assert encoded(tokenizer, f"owner/rows@{main_commit}", datasets_cache) == main
    # data.eval_split: the revision's own test split is the eval set (data.eval_fraction gives way to it).
    cfg = data_cfg("owner/rows@v1", datasets_cache, eval_split="test", eval_fraction=0.5)
    data = build_datasets(cfg, tokenizer, seed=0)
    assert (data.train["input_ids"], data.eval["input_ids"]) == (v1, main)
    with pytest.raises(ValueError) as info:
        encoded(tokenizer, "owner/rows@v2", datasets_cache)
    assert str(info.value).startswith("data.path=owner/rows@v2: ")
    assert "no local cache holds it at revision v2" in str(info.value)
    assert "`hf download --repo-type dataset owner/rows --revision v2`" in str(info.value)
    assert offline == []


def test_eval_split_reads_a_folders_own_split_for_data_path_eval_path_and_each_source(
    tokenizer, tmp_path, datasets_cache
):
    repo = tmp_path / "repo"
    write_parquet(repo / "data" / "train-00000-of-00001.parquet", ROWS[:3])
    write_parquet(repo / "data" / "test-00000-of-00001.parquet", ROWS[3:])
    rows = write_jsonl(tmp_path / "rows.jsonl", ROWS[:2])
    train, test = reference(tokenizer, ROWS[:3]), reference(tokenizer, ROWS[3:])
    data = build_datasets(data_cfg(str(repo), datasets_cache, eval_split="test"), tokenizer, seed=0)
    assert (data.train["input_ids"], data.eval["input_ids"]) == (train, test)
    cfg = data_cfg(str(rows), datasets_cache, eval_path=str(repo), eval_split="test")
    assert build_datasets(cfg, tokenizer, seed=0).eval["input_ids"] == test
    mixture = DataConfig(
        path=None,
        cache_dir=str(datasets_cache),
        sources=[SourceConfig(path=str(repo), eval_split="test"), SourceConfig(path=str(rows), eval_fraction=0.5)],
    )
    data = build_datasets(mixture, tokenizer, seed=0)
    assert data.eval["source"].count(0) == len(test) and data.eval["input_ids"][: len(test)] == test
    assert data.train["source"].count(0) == len(train), "source 0 trains on its whole train split"
    with pytest.raises(ValueError, match=r"data\.path=.*repo: Unknown split \"validation\".*Set data\.eval_split to"):
        build_datasets(data_cfg(str(repo), datasets_cache, eval_split="validation"), tokenizer, seed=0)


# ----------------------------------------------------------------------------- config checks


def test_config_refuses_a_revision_or_eval_split_where_it_cannot_act(tmp_path):
    mixture = ["data=mixture", f"data.sources=[{{path: {ASSET_ROWS}}}]"]
    cases = [
        (["data.revision=v1"], r"data\.revision=v1 applies to Hub dataset ids only, and data\.path=.* is a local file"),
        ([f"data.path={tmp_path}", "data.revision=v1"], r"data\.revision=v1 applies to .* is a local folder"),
        (["data.path=owner/rows@v1", "data.revision=v2"], r"data\.path=owner/rows@v1 pins revision v1, but data\.rev"),
        (["data.eval_split=test"], r"data\.eval_split=test: data\.path=.* names files, which have one split"),
        ([f"data.path={tmp_path}", "data.eval_split=train"], r"data\.eval_split=train is also the split trained on"),
        ([*mixture, "data.eval_split=test"], r"data\.eval_split=test applies to data\.path, not to a mixture"),
        ([*mixture, "data.revision=v1"], r"data\.revision=v1 applies to data\.path, not to a mixture"),
        (
            ["data=mixture", f"data.sources=[{{path: {ASSET_ROWS}, eval_split: test}}]"],
            r"sources\[0\]\.eval_split=test: ",
        ),
        (
            ["data=mixture", f"data.sources=[{{path: {ASSET_ROWS}, revision: v1}}]"],
            r"sources\[0\]\.revision=v1 applies",
        ),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            compose_config(overrides)
    cfg = compose_config(["data.path=owner/rows@v1", "data.revision=v1", f"data.eval_path={tmp_path}"])
    assert (cfg.data.path, cfg.data.revision) == ("owner/rows@v1", "v1"), "the same revision twice is no conflict"


@pytest.mark.parametrize("path", ["./no/such/rows.jsonl", "/no/such/folder", "~/no/such/rows.parquet", "rows.csv"])
def test_config_refuses_a_local_path_that_does_not_exist(path):
    with pytest.raises(ConfigError, match=rf"data\.path={re.escape(path)}: no such file\. Point data\.path at"):
        compose_config([f"data.path='{path}'"])


def test_config_refuses_a_glob_without_matches_and_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=rf"data\.eval_path={re.escape(str(tmp_path))}/\*\.jsonl: the pattern"):
        compose_config([f"data.eval_path={tmp_path}/*.jsonl"])


def test_config_lets_hub_ids_and_folders_through(tmp_path):
    cfg = compose_config(["data.path=tatsu-lab/alpaca", "data.subset=default", "data.split='train[:90%]'"])
    assert (cfg.data.path, cfg.data.subset, cfg.data.split) == ("tatsu-lab/alpaca", "default", "train[:90%]")
    assert compose_config([f"data.path={tmp_path}", "data.split=test"]).data.split == "test"


def test_config_refuses_split_and_subset_for_files():
    with pytest.raises(ConfigError) as info:
        compose_config(["data.split=test", "data.subset=short"])  # data=tiny_instruct: one .jsonl file
    assert [p.split(" has no effect")[0] for p in info.value.problems] == ["data.split=test", "data.subset=short"]
    assert "Remove data.split" in info.value.problems[0]


def test_csv_columns_are_read_as_text_whatever_they_look_like(tmp_path, datasets_cache) -> None:
    """Digits stay text, empty cells stay empty strings, and a column empty for the first 10k rows loads."""
    path = tmp_path / "rows.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["instruction", "input", "output"])
        writer.writerows([f"Add {i} and 1.", "", str(i + 1)] for i in range(12_000))
        writer.writerow(["Say hi.", "politely", "hi"])
    rows = load_rows(str(path), str(datasets_cache))
    assert rows[0] == {"instruction": "Add 0 and 1.", "input": "", "output": "1"}
    assert rows[12_000] == {"instruction": "Say hi.", "input": "politely", "output": "hi"}
