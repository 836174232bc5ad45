"""Mixtures of datasets (``data.sources``): each source read with its own settings, mixed by weight."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from ddptrain.config import ConfigError, Template
from ddptrain.data import build_batching_spec, build_datasets, mixture_indices
from ddptrain.data.sampler import DistributedBatchSampler
from ddptrain.model import build_tokenizer
from tests.conftest import ALPACA, compose_config, requires_shared

ASSETS = Path(__file__).resolve().parents[2] / "ddptrain" / "assets"


def sharegpt_file(path: Path) -> Path:
    """The bundled chat conversations rewritten as ShareGPT rows."""
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    rows = [json.loads(line) for line in (ASSETS / "tiny_chat.jsonl").read_text().splitlines()]
    turns = [[{"from": speaker[m["role"]], "value": m["content"]} for m in row["messages"]] for row in rows]
    path.write_text("".join(json.dumps({"conversations": t}) + "\n" for t in turns))
    return path


def test_weights_set_each_sources_share_and_a_short_source_is_repeated() -> None:
    picks = mixture_indices([1000, 100], [0.7, 0.3], seed=0)
    assert [len(p) for p in picks] == [770, 330]
    assert len(set(picks[0].tolist())) == 770, "a long source is subsampled without repeats"
    assert Counter(Counter(picks[1].tolist()).values()) == {4: 30, 3: 70}, "whole repeats, then a random part"
    again = mixture_indices([1000, 100], [0.7, 0.3], seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(picks, again))
    assert not np.array_equal(mixture_indices([1000, 100], [0.7, 0.3], seed=1)[0], picks[0])
    next_epoch = mixture_indices([1000, 100], [0.7, 0.3], seed=0, epoch=1)
    assert [len(p) for p in next_epoch] == [770, 330]
    assert set(next_epoch[0].tolist()) != set(picks[0].tolist()), "a subsampled source draws other rows next epoch"
    assert [p.tolist() for p in mixture_indices([3, 2], [None, None], seed=0)] == [[0, 1, 2], [0, 1]]


@requires_shared
def test_alpaca_and_sharegpt_mixed_70_30_over_an_epoch_the_same_on_every_rank_and_rerun(tmp_path) -> None:
    sharegpt = sharegpt_file(tmp_path / "sharegpt.jsonl")
    sources = (
        f"[{{path: {ALPACA}, template: alpaca, max_rows: 2000, weight: 0.7}}, "
        f"{{path: {sharegpt}, template: sharegpt, weight: 0.3}}]"
    )
    overrides = ["data=mixture", f"data.sources={sources}", "data.max_length=512", "data.eval_fraction=0"]

    def epoch_draws(cache: str, epoch: int) -> dict[int, list[tuple[int, int]]]:
        """(source, row of the training set) of every sample each rank trains on in ``epoch``."""
        cfg = compose_config([*overrides, f"data.cache_dir={cache}"])
        data = build_datasets(cfg.data, build_tokenizer(cfg.model), cfg.trainer.seed)
        spec = build_batching_spec(cfg.data, world_size=2, grad_accum_steps=1, seed=cfg.trainer.seed)
        sources = data.train["source"]
        per_rank = {}
        for rank in (0, 1):
            sampler = DistributedBatchSampler(data.train["length"], spec, rank, data.epoch_rows)
            sampler.set_epoch(epoch)
            per_rank[rank] = [(sources[i], i) for batch in sampler for row in batch for i in row]
        return per_rank

    per_rank = epoch_draws(str(tmp_path / "cache1"), epoch=0)
    drawn = Counter(source for rank in per_rank.values() for source, _ in rank)
    total = sum(drawn.values())
    assert abs(drawn[0] / total - 0.7) < 0.02 and abs(drawn[1] / total - 0.3) < 0.02, drawn
    alpaca_by_rank = [{i for source, i in per_rank[rank] if source == 0} for rank in (0, 1)]
    assert not alpaca_by_rank[0] & alpaca_by_rank[1], "a subsampled row is drawn once, so it sits on one rank"
    rerun = epoch_draws(str(tmp_path / "cache2"), epoch=0)  # a fresh cache: built again from the files
    assert rerun == per_rank, "a rerun with the same seed draws the same samples on the same ranks"
    next_epoch = epoch_draws(str(tmp_path / "cache2"), epoch=1)
    alpaca = [{i for source, i in draws[0] + draws[1] if source == 0} for draws in (per_rank, next_epoch)]
    assert alpaca[0] != alpaca[1], "Alpaca is subsampled: another epoch draws other rows"


def test_each_source_uses_its_own_template_and_fields_and_data_keys_for_the_rest(tmp_path) -> None:
    alpaca = tmp_path / "qa.jsonl"
    alpaca.write_text(json.dumps({"q": "Say hi.", "a": "hi"}) + "\n" + json.dumps({"q": "Say yo.", "a": "yo"}) + "\n")
    sharegpt = sharegpt_file(tmp_path / "sharegpt.jsonl")
    sources = (
        f"[{{path: {alpaca}, instruction_field: q, output_field: a}}, "
        f"{{path: {sharegpt}, template: sharegpt, max_rows: 5}}]"
    )
    cfg = compose_config(["data=mixture", f"data.sources={sources}", f"data.cache_dir={tmp_path / 'cache'}"])
    assert cfg.data.template == Template.alpaca
    data = build_datasets(cfg.data, build_tokenizer(cfg.model), cfg.trainer.seed)
    assert Counter(data.train["source"]) == {0: 2, 1: 5}, "without weights: every row of every source, once"


def test_a_mixture_refuses_half_set_weights_and_a_second_data_path(tmp_path) -> None:
    half = "[{path: a.jsonl, weight: 0.5}, {path: b.jsonl}]"
    with pytest.raises(ConfigError, match=r"weights \[0\.5, None\] are set on some sources only"):
        compose_config(["data=mixture", f"data.sources={half}"])
    with pytest.raises(ConfigError, match=r"data\.sources and data\.path=.* are both set"):
        compose_config(["data=tiny_instruct", "data.sources=[{path: a.jsonl}]"])


def test_a_mixture_refuses_settings_that_would_be_ignored(tmp_path) -> None:
    rows = ASSETS / "tiny_instruct.jsonl"
    with pytest.raises(ConfigError, match=r"data\.max_rows=10 applies to data\.path, not to a mixture"):
        compose_config(["data=mixture", f"data.sources=[{{path: {rows}}}]", "data.max_rows=10"])
    with pytest.raises(ConfigError, match=r"data\.sources\[0\] sets split=test .* no effect"):
        compose_config(["data=mixture", f"data.sources=[{{path: {rows}, split: test}}]"])


def test_each_source_holds_out_its_own_eval_share(tmp_path) -> None:
    many = tmp_path / "many.jsonl"
    many.write_text("".join(json.dumps({"instruction": f"Count to {i}.", "output": str(i)}) + "\n" for i in range(100)))
    sharegpt = sharegpt_file(tmp_path / "sharegpt.jsonl")
    sources = f"[{{path: {many}, eval_fraction: 0.2, weight: 1}}, {{path: {sharegpt}, template: sharegpt, weight: 1}}]"
    cfg = compose_config(["data=mixture", f"data.sources={sources}", f"data.cache_dir={tmp_path / 'cache'}"])
    data = build_datasets(cfg.data, build_tokenizer(cfg.model), cfg.trainer.seed)
    assert Counter(data.eval["source"]) == {0: 20}, "20% of source 0 held out, none of source 1 (eval_fraction 0)"
    held_out = {tuple(ids) for ids in data.eval["input_ids"]}
    assert not held_out & {tuple(ids) for ids in data.train["input_ids"]}, "a held-out row is also trained on"
