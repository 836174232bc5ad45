"""Loading, prompt masking, truncation, bad-row errors, caching, eval split and the collator."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import datasets
import pytest
import torch

from ddptrain.config import DataConfig, Template
from ddptrain.data import IGNORE_INDEX, Collator, RowEncoder, RowsDataset, build_datasets, load_rows, tokenize_file
from ddptrain.data.templates import alpaca_prompt
from ddptrain.model import build_tokenizer
from tests.conftest import compose_config

ROWS = [
    {"instruction": "Reverse the words.", "input": "red fox", "output": "fox red"},
    {"instruction": "Spell the word 'sun'.", "input": "", "output": "s-u-n"},
    {"instruction": "Add the two numbers.", "input": "2 + 3", "output": "5"},
    {"instruction": "Repeat 'ok' 3 times.", "input": "", "output": "ok ok ok"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(compose_config([]).model)


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def data_cfg(path: str, cache: Path, **kwargs) -> DataConfig:
    return DataConfig(path=path, cache_dir=str(cache), **kwargs)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


# ----------------------------------------------------------------------------- encoding


def test_prompt_is_masked_and_response_plus_eos_are_labels(tokenizer, tmp_path, datasets_cache):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    data, stats = tokenize_file(path, data_cfg(path, datasets_cache), tokenizer, None)
    assert stats == {"rows": 4, "truncated": 0, "skipped_bad": 0, "no_target": 0}
    assert set(data.column_names) == {"input_ids", "labels", "length"}
    for row, encoded in zip(ROWS, data):
        prompt = ids(tokenizer, alpaca_prompt(row["instruction"], row["input"]))
        response = ids(tokenizer, row["output"])
        eos = tokenizer.eos_token_id
        assert encoded["input_ids"] == prompt + response + [eos]
        assert encoded["labels"] == [IGNORE_INDEX] * len(prompt) + response + [eos]
        assert encoded["length"] == len(encoded["input_ids"])


def test_truncation_at_max_length_is_counted(tokenizer, tmp_path, datasets_cache):
    row = ROWS[3]
    prompt = ids(tokenizer, alpaca_prompt(row["instruction"], row["input"]))
    response = ids(tokenizer, row["output"])
    max_length = len(prompt) + 2  # keeps two response tokens, drops the rest and the EOS
    assert len(response) > 2
    path = write_jsonl(tmp_path / "rows.jsonl", [row, {**row, "output": "o"}])
    cfg = data_cfg(path, datasets_cache, max_length=max_length)
    data, stats = tokenize_file(path, cfg, tokenizer, None)
    assert stats["truncated"] == 1
    assert stats["no_target"] == 0
    assert data[0]["input_ids"] == prompt + response[:2]
    assert data[0]["labels"] == [IGNORE_INDEX] * len(prompt) + response[:2]
    assert data[0]["length"] == max_length
    assert len(data[1]["input_ids"]) <= max_length


def test_rows_whose_prompt_fills_max_length_are_dropped_and_counted(tokenizer, tmp_path, datasets_cache):
    short = {"instruction": "Hi.", "output": "hello there"}
    long = {"instruction": "Hi. " + "Please answer politely and briefly. " * 4, "output": "hello"}
    limit = len(ids(tokenizer, alpaca_prompt(long["instruction"], "")))
    short_length = len(ids(tokenizer, alpaca_prompt(short["instruction"], ""))) + len(ids(tokenizer, "hello there")) + 1
    assert short_length <= limit
    path = write_jsonl(tmp_path / "rows.jsonl", [short, long, short])

    data, stats = tokenize_file(path, data_cfg(path, datasets_cache, max_length=limit), tokenizer, None)
    assert stats["no_target"] == 1
    assert stats["truncated"] == 1  # the long row; the short ones fit
    assert len(data) == 2
    assert all(any(label != IGNORE_INDEX for label in row["labels"][1:]) for row in data)

    # One more position leaves a single target token for the long row: it is kept.
    _, stats = tokenize_file(path, data_cfg(path, datasets_cache, max_length=limit + 1), tokenizer, None)
    assert stats["no_target"] == 0


def test_chat_template_labels_only_assistant_turns(tokenizer, tmp_path, datasets_cache):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "1 2 3"},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    cfg = data_cfg(path, datasets_cache, template=Template.chat)
    data, _ = tokenize_file(path, cfg, tokenizer, None)
    row = data[0]
    labelled = [t for t, label in zip(row["input_ids"], row["labels"]) if label != IGNORE_INDEX]
    masked = [t for t, label in zip(row["input_ids"], row["labels"]) if label == IGNORE_INDEX]
    assert [label for label in row["labels"] if label != IGNORE_INDEX] == labelled
    assert tokenizer.decode(labelled) == "hi<|im_end|>1 2 3<|im_end|>" + tokenizer.eos_token
    prompt_text = tokenizer.decode(masked)
    for m in messages[:2] + messages[3:4]:
        assert m["content"] in prompt_text
    assert "1 2 3" not in prompt_text
    assert tokenizer.decode(row["input_ids"]).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_encoder_turns_follow_the_configured_fields(tokenizer, datasets_cache):
    cfg = DataConfig(path="unused.jsonl", instruction_field="q", input_field="ctx", output_field="a")
    encoder = RowEncoder(cfg, tokenizer)
    assert encoder.turns({"q": "2+2?", "ctx": "math", "a": "4"}) == [(alpaca_prompt("2+2?", "math"), "4")]


# ----------------------------------------------------------------------------- errors and formats


def test_malformed_row_names_file_line_and_the_skip_option(tokenizer, tmp_path, datasets_cache):
    rows = [ROWS[0], ROWS[1], {"instruction": "No output here."}, ROWS[2]]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError) as info:
        tokenize_file(path, data_cfg(path, datasets_cache), tokenizer, None)
    message = str(info.value)
    assert f"{path}:3:" in message
    assert "'output'" in message
    assert "data.skip_bad_rows" in message


def test_malformed_row_error_does_not_list_the_missing_field_as_present(tokenizer, tmp_path, datasets_cache):
    # datasets gives every row every column (None where absent); the message must still be right.
    path = write_jsonl(tmp_path / "bad.jsonl", [ROWS[1], {"instruction": "No output here.", "input": ""}])
    with pytest.raises(ValueError, match="missing field 'output'") as info:
        tokenize_file(path, data_cfg(path, datasets_cache), tokenizer, None)
    present = str(info.value).split("present:", 1)[1].split(")", 1)[0]
    assert "output" not in present


def test_malformed_row_line_number_counts_blank_lines(tokenizer, tmp_path, datasets_cache):
    path = tmp_path / "blank.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps({"instruction": "No output here."}) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:3:")):
        tokenize_file(str(path), data_cfg(str(path), datasets_cache), tokenizer, None)


def test_skip_bad_rows_drops_and_counts_them(tokenizer, tmp_path, datasets_cache):
    rows = [ROWS[0], {"instruction": "No output here."}, ROWS[1], {"output": "no instruction"}]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    data, stats = tokenize_file(path, data_cfg(path, datasets_cache, skip_bad_rows=True), tokenizer, None)
    assert stats["skipped_bad"] == 2
    assert stats["rows"] == 4
    assert len(data) == 2
    good = [ids(tokenizer, alpaca_prompt(r["instruction"], r["input"])) for r in (ROWS[0], ROWS[1])]
    assert [row["input_ids"][: len(prompt)] for row, prompt in zip(data, good)] == good


def test_invalid_json_line_names_path_and_line(tmp_path, datasets_cache):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1]) + "\n" + '{"instruction": "x", "output": \n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: not valid JSON")):
        load_rows(str(path), str(datasets_cache))


def test_unsupported_extension_is_a_value_error(tmp_path, datasets_cache):
    path = tmp_path / "rows.txt"
    path.write_text("instruction,output\na,b\n")
    with pytest.raises(ValueError, match=r"unsupported file type '\.txt'.*\.jsonl"):
        load_rows(str(path), str(datasets_cache))


def test_custom_field_names_load_without_code_changes(tokenizer, tmp_path, datasets_cache):
    rows = [{"q": "What is 2 + 2?", "ctx": "", "a": "4"}, {"q": "Name a colour.", "ctx": "warm", "a": "red"}]
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    cfg = data_cfg(path, datasets_cache, instruction_field="q", input_field="ctx", output_field="a")
    data, stats = tokenize_file(path, cfg, tokenizer, None)
    assert stats["skipped_bad"] == 0 and len(data) == 2
    for row, encoded in zip(rows, data):
        prompt = ids(tokenizer, alpaca_prompt(row["q"], row["ctx"]))
        assert encoded["input_ids"] == prompt + ids(tokenizer, row["a"]) + [tokenizer.eos_token_id]


def test_parquet_and_json_files_encode_like_jsonl(tokenizer, tmp_path, datasets_cache):
    jsonl = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    parquet = str(tmp_path / "rows.parquet")
    datasets.Dataset.from_list(ROWS).to_parquet(parquet)
    array = tmp_path / "rows.json"
    array.write_text(json.dumps(ROWS))
    reference, _ = tokenize_file(jsonl, data_cfg(jsonl, datasets_cache), tokenizer, None)
    for path in (parquet, str(array)):
        data, stats = tokenize_file(path, data_cfg(path, datasets_cache), tokenizer, None)
        assert stats["rows"] == len(ROWS)
        assert data["input_ids"] == reference["input_ids"]
        assert data["labels"] == reference["labels"]


def test_max_rows_uses_only_the_first_rows(tokenizer, tmp_path, datasets_cache):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    cfg = data_cfg(path, datasets_cache, max_rows=2)
    full, _ = tokenize_file(path, cfg, tokenizer, None)
    first, stats = tokenize_file(path, cfg, tokenizer, 2)
    assert stats["rows"] == 2
    assert first["input_ids"] == full["input_ids"][:2]


# ----------------------------------------------------------------------------- caching


def _cache_state(data: datasets.Dataset) -> list[tuple[str, int, int]]:
    return [
        (f["filename"], os.stat(f["filename"]).st_ino, os.stat(f["filename"]).st_mtime_ns) for f in data.cache_files
    ]


def test_second_build_reuses_the_tokenized_cache(tokenizer, tmp_path, datasets_cache):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    cfg = data_cfg(path, datasets_cache, max_length=64)
    first, _ = tokenize_file(path, cfg, tokenizer, None)
    state = _cache_state(first)
    assert any("cache-" in name for name, _, _ in state), "the tokenized set is written to the datasets cache"

    again, _ = tokenize_file(path, cfg, tokenizer, None)
    assert again._fingerprint == first._fingerprint
    assert _cache_state(again) == state  # same files, not rewritten: the map did not run again
    assert again["input_ids"] == first["input_ids"]

    shorter, _ = tokenize_file(path, replace(cfg, max_length=32), tokenizer, None)
    assert shorter._fingerprint != first._fingerprint
    assert {f["filename"] for f in shorter.cache_files} != {f["filename"] for f in first.cache_files}


def test_changed_file_contents_are_not_served_from_a_stale_cache(tokenizer, tmp_path, datasets_cache):
    path = tmp_path / "rows.jsonl"
    write_jsonl(path, ROWS[:2])
    first, _ = tokenize_file(str(path), data_cfg(str(path), datasets_cache), tokenizer, None)
    write_jsonl(path, [ROWS[2], ROWS[3]])
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    second, _ = tokenize_file(str(path), data_cfg(str(path), datasets_cache), tokenizer, None)
    assert second._fingerprint != first._fingerprint
    prompt = ids(tokenizer, alpaca_prompt(ROWS[2]["instruction"], ROWS[2]["input"]))
    assert second[0]["input_ids"][: len(prompt)] == prompt


# ----------------------------------------------------------------------------- eval split


def _as_tuples(data: datasets.Dataset) -> list[tuple[int, ...]]:
    return [tuple(x) for x in data["input_ids"]]


def test_eval_fraction_holds_out_disjoint_rows(tokenizer, tmp_path, datasets_cache):
    rows = [{"instruction": f"Say the number {i}.", "output": str(i)} for i in range(20)]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    cfg = data_cfg(path, datasets_cache, eval_fraction=0.25)
    data = build_datasets(cfg, tokenizer, seed=0)
    train, held_out = _as_tuples(data.train), _as_tuples(data.eval)
    assert len(held_out) == 5 and len(train) == 15
    assert set(train).isdisjoint(held_out)
    everything, _ = tokenize_file(path, cfg, tokenizer, None)
    assert sorted(train + held_out) == sorted(_as_tuples(everything))
    # The split depends on the seed only: every rank (and a resumed run) gets the same one.
    assert _as_tuples(build_datasets(cfg, tokenizer, seed=0).eval) == held_out


def test_no_eval_split_by_default(tokenizer, tmp_path, datasets_cache):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    data = build_datasets(data_cfg(path, datasets_cache), tokenizer, seed=0)
    assert data.eval is None and len(data.train) == len(ROWS)


def test_eval_path_is_used_when_given(tokenizer, tmp_path, datasets_cache):
    train_path = write_jsonl(tmp_path / "train.jsonl", ROWS[:3])
    eval_path = write_jsonl(tmp_path / "eval.jsonl", ROWS[3:])
    cfg = data_cfg(train_path, datasets_cache, eval_path=eval_path, eval_fraction=0.5)
    data = build_datasets(cfg, tokenizer, seed=0)
    assert len(data.train) == 3  # eval_path wins: nothing is held out of the training file
    assert len(data.eval) == 1
    prompt = ids(tokenizer, alpaca_prompt(ROWS[3]["instruction"], ROWS[3]["input"]))
    assert data.eval[0]["input_ids"][: len(prompt)] == prompt
    assert data.stats["eval_rows"] == 1


def test_no_usable_rows_is_a_value_error(tokenizer, tmp_path, datasets_cache):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"instruction": "x"}, {"instruction": "y"}])
    with pytest.raises(ValueError, match="no usable rows"):
        build_datasets(data_cfg(path, datasets_cache, skip_bad_rows=True), tokenizer, seed=0)


# ----------------------------------------------------------------------------- collate


def sample(input_ids: list[int], n_prompt: int) -> dict[str, list[int]]:
    return {"input_ids": input_ids, "labels": [IGNORE_INDEX] * n_prompt + input_ids[n_prompt:]}


SAMPLES = [sample([11, 12, 13, 14, 15], 2), sample([21, 22, 23], 1), sample([31, 32, 33, 34, 35, 36, 37, 38, 39], 4)]


def test_pad_collator_shapes_mask_and_padding():
    batch = Collator(pad_id=0, pad_to_multiple_of=1)([[s] for s in SAMPLES])
    assert set(batch) == {"input_ids", "labels", "attention_mask", "target_index"}
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (3, 9)
    assert batch["input_ids"].dtype == torch.long
    for i, s in enumerate(SAMPLES):
        n = len(s["input_ids"])
        assert batch["input_ids"][i, :n].tolist() == s["input_ids"]
        assert batch["labels"][i, :n].tolist() == s["labels"]
        assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (9 - n)
        assert batch["input_ids"][i, n:].tolist() == [0] * (9 - n)
        assert batch["labels"][i, n:].tolist() == [IGNORE_INDEX] * (9 - n)


@pytest.mark.parametrize(("multiple", "width"), [(1, 9), (4, 12), (8, 16), (9, 9)])
def test_pad_collator_rounds_width_up_to_the_multiple(multiple, width):
    batch = Collator(pad_id=7, pad_to_multiple_of=multiple)([[s] for s in SAMPLES])
    assert batch["input_ids"].shape == (3, width)
    assert batch["input_ids"][2, 9:].tolist() == [7] * (width - 9)
    assert int(batch["attention_mask"].sum()) == sum(len(s["input_ids"]) for s in SAMPLES)


def test_pack_collator_concatenates_with_restarting_positions():
    batch = Collator(pad_id=0, packed=True)([SAMPLES])
    # No attention mask: the positions separate the samples.
    assert set(batch) == {"input_ids", "labels", "position_ids", "target_index"}
    total = sum(len(s["input_ids"]) for s in SAMPLES)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (1, total)
    assert batch["input_ids"][0].tolist() == [t for s in SAMPLES for t in s["input_ids"]]
    assert batch["position_ids"][0].tolist() == [*range(5), *range(3), *range(9)]
    labels = batch["labels"][0].tolist()
    starts = [0, 5, 8]
    for start, s in zip(starts, SAMPLES):
        assert labels[start] == IGNORE_INDEX  # never predicted from the previous sample
        n = len(s["input_ids"])
        assert labels[start + 1 : start + n] == s["labels"][1:]


def test_pack_collator_masks_a_sample_whose_first_token_is_a_target():
    # Even a fully-labelled sample must not be predicted across the boundary.
    batch = Collator(pad_id=0, packed=True)([[sample([1, 2, 3], 0), sample([4, 5], 0)]])
    assert batch["labels"][0].tolist() == [IGNORE_INDEX, 2, 3, IGNORE_INDEX, 5]


def test_rows_dataset_returns_the_samples_of_a_row(tokenizer, tmp_path, datasets_cache):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    data, _ = tokenize_file(path, data_cfg(path, datasets_cache), tokenizer, None)
    rows = RowsDataset(data)
    assert len(rows) == len(ROWS)
    got = rows[(2, 0)]
    assert [set(s) for s in got] == [{"input_ids", "labels"}] * 2
    assert got[0]["input_ids"] == data[2]["input_ids"] and got[1]["labels"] == data[0]["labels"]
    batch = Collator(pad_id=tokenizer.pad_token_id)([rows[(i,)] for i in range(len(ROWS))])
    assert batch["attention_mask"].sum(1).tolist() == data["length"]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_target_index_names_exactly_the_positions_whose_next_label_is_a_target(packed):
    rows = [SAMPLES] if packed else [[s] for s in SAMPLES]
    batch = Collator(pad_id=0, pad_to_multiple_of=4, packed=packed)(rows)
    labels = batch["labels"]
    width = labels.shape[1]
    rows_, columns = range(labels.shape[0]), range(width - 1)
    expected = [r * width + c for r in rows_ for c in columns if labels[r, c + 1] != IGNORE_INDEX]
    assert batch["target_index"].tolist() == expected
    assert len(expected) == sum(int(x != IGNORE_INDEX) for x in labels[:, 1:].flatten())


def test_packed_row_carries_flash_attention_varlen_lengths_as_transformers_would_derive_them():
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    batch = Collator(pad_id=0, packed=True, flash_varlen=True)([SAMPLES])
    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(batch["position_ids"])
    assert batch["cu_seq_lens_q"].dtype == cu_q.dtype == torch.int32
    assert batch["cu_seq_lens_q"].tolist() == cu_q.tolist() == [0, 5, 8, 17]
    assert batch["cu_seq_lens_k"].tolist() == cu_k.tolist()
    assert batch["max_length_q"] == batch["max_length_k"] == int(max_q) == int(max_k) == 9
    assert "cu_seq_lens_q" not in Collator(pad_id=0, packed=True)([SAMPLES]), "only for flash_attention_2"


def _pid_of_the_worker(rows: list) -> int:
    return os.getpid()


def _rank_with_loader_workers(pids_file: Path) -> None:
    """A rank's training loader with 2 workers, each of which tells its pid; then the rank waits to be killed."""
    from types import SimpleNamespace

    from ddptrain.data.loader import _build_loader

    train = datasets.Dataset.from_dict({"input_ids": [[1, 2]] * 4, "labels": [[1, 2]] * 4})
    batches = [[(i % 4,)] for i in range(64)]
    env = SimpleNamespace(device=torch.device("cpu"))
    loader = _build_loader(train, batches, _pid_of_the_worker, num_workers=2, env=env, seed=0)
    epoch = iter(loader)  # kept: the workers live as long as the epoch's iterator
    pids = {next(epoch), next(epoch)}  # one micro-batch from each worker, in turn
    written = pids_file.with_suffix(".partial")
    written.write_text(" ".join(map(str, pids)))
    written.replace(pids_file)  # whole or absent: the test reads it as soon as it exists
    time.sleep(120)


def _running(pid: int) -> bool:
    """Whether ``pid`` is still a live process (an exited one nobody reaped yet counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.skipif(sys.platform != "linux", reason="the kernel's parent-death signal is Linux's")
def test_a_rank_killed_outright_takes_its_loader_workers_with_it(tmp_path) -> None:
    """A rank SIGKILLed (the OOM killer) must not leave its loader workers running: they hold the pipe by which a
    self-launch's agent sees the rank exit, and noticed the loss only at their own check, every 5 s, so the agent
    restarted the group 5 s late."""
    pids_file = tmp_path / "worker-pids"
    rank = multiprocessing.get_context("fork").Process(target=_rank_with_loader_workers, args=(pids_file,))
    rank.start()
    try:
        deadline = time.monotonic() + 60
        while not pids_file.exists() and rank.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        workers = [int(p) for p in pids_file.read_text().split()]
        assert len(workers) == 2 and os.getpid() not in workers, workers
        assert all(_running(pid) for pid in workers)
    finally:
        rank.kill()
        rank.join()
    deadline = time.monotonic() + 2
    while any(_running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [pid for pid in workers if _running(pid)], "the killed rank's loader workers outlived it by 2 s"
