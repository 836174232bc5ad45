"""Preference pairs (issue 40): how a row becomes a chosen and a rejected sequence, how a pair is cut to
data.max_length, how pairs are collated and counted, and the objective group's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddptrain.config import ConfigError, DataConfig, Template
from ddptrain.data import IGNORE_INDEX, Collator, loss_units, tokenize_file
from ddptrain.data.preference import cut_pair
from ddptrain.model import build_tokenizer
from tests.conftest import REPO, compose_config
from tests.unit.test_chat_templates import family, target_runs

PROMPT = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "Name a prime number."},
    {"role": "assistant", "content": "Seven."},
    {"role": "user", "content": "And an even one?"},
]
CHOSEN, REJECTED = "Two, the only even prime.", "Four."


def encode(rows: list[dict], tmp_path: Path, tokenizer, **settings):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"), template=Template.preference, **settings)
    return tokenize_file(str(path), cfg, tokenizer, None)


def tiny_tokenizer():
    return build_tokenizer(compose_config([]).model)


def test_a_plain_pair_is_the_prompt_then_each_reply_and_the_eos_trained_on_the_reply(tmp_path) -> None:
    tokenizer = tiny_tokenizer()
    row = {"prompt": "Question: 2+2?\nAnswer:", "chosen": " 4", "rejected": " I cannot help."}
    data, stats = encode([row], tmp_path, tokenizer)
    prompt = tokenizer(row["prompt"], add_special_tokens=False).input_ids
    for reply, ids, labels in (
        (" 4", "input_ids", "labels"),
        (" I cannot help.", "rejected_input_ids", "rejected_labels"),
    ):
        reply_ids = [*tokenizer(reply, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
        assert data[0][ids] == prompt + reply_ids
        assert data[0][labels] == [IGNORE_INDEX] * len(prompt) + reply_ids
    longest = max(len(data[0]["input_ids"]), len(data[0]["rejected_input_ids"]))
    assert data[0]["length"] == 2 * longest, "the batch plan costs a pair as its two sequences padded to one width"
    assert stats["truncated"] == stats["skipped_bad"] == 0


@pytest.mark.parametrize("name", ["llama3.1", "gemma", "qwen3"])
@pytest.mark.parametrize("layout", ["prompt and replies", "whole conversations", "prompt beside conversations"])
def test_a_chat_pair_is_the_models_template_and_trains_the_last_reply_alone(name, layout, tmp_path) -> None:
    """Each sequence is apply_chat_template of the prompt's messages and the reply, token for token (one BOS, one
    system prompt), and its trained tokens are that reply with its end-of-turn: not the earlier assistant turn."""
    tokenizer, reply_end = family(name)
    prompt = PROMPT[1:] if name == "gemma" else PROMPT  # Gemma refuses a system message
    chosen, rejected = ({"role": "assistant", "content": text} for text in (CHOSEN, REJECTED))
    if layout == "prompt and replies":
        row = {"prompt": prompt, "chosen": CHOSEN, "rejected": [rejected]}
    else:  # as Hub datasets ship them; UltraFeedback also repeats the user's text in a prompt field
        row = {"chosen": [*prompt, chosen], "rejected": [*prompt, rejected]}
        if layout == "prompt beside conversations":
            row["prompt"] = prompt[-1]["content"]
    data, _ = encode([row], tmp_path, tokenizer)
    start = {"qwen3": "<think>\n\n</think>\n\n"}.get(name, "")  # written before the last reply only
    for reply, ids, labels in ((chosen, "input_ids", "labels"), (rejected, "rejected_input_ids", "rejected_labels")):
        expected = tokenizer.apply_chat_template([*prompt, reply], tokenize=True)["input_ids"]
        assert data[0][ids] == expected
        trained = target_runs(data[0][ids], data[0][labels], tokenizer)
        assert trained == [start + reply_end.format(reply["content"])]


def test_a_long_pair_loses_its_prompts_start_first_then_the_replies_end() -> None:
    prompt, reply_c, reply_r = list(range(10)), list(range(100, 106)), list(range(200, 203))
    chosen = (prompt + reply_c, [IGNORE_INDEX] * 10 + reply_c)
    rejected = (prompt + reply_r, [IGNORE_INDEX] * 10 + reply_r)
    (c, r), truncated = cut_pair(chosen, rejected, max_length=12)
    assert truncated
    assert c == (list(range(4, 10)) + reply_c, [IGNORE_INDEX] * 6 + reply_c), "4 prompt tokens cut from the left"
    assert r == (list(range(4, 10)) + reply_r, [IGNORE_INDEX] * 6 + reply_r)
    long_reply = list(range(100, 110))  # the prompt keeps its last token, then the replies are cut
    chosen = ([0, 1, 2, 3, *long_reply], [IGNORE_INDEX] * 4 + long_reply)
    rejected = ([0, 1, 2, 3, 200], [IGNORE_INDEX] * 4 + [200])
    (c, r), _ = cut_pair(chosen, rejected, max_length=8)
    assert c == ([3, *long_reply[:7]], [IGNORE_INDEX, *long_reply[:7]]) and r == ([3, 200], [IGNORE_INDEX, 200])
    chosen, rejected = (
        (prompt + reply_c, [IGNORE_INDEX] * 10 + reply_c),
        (prompt + reply_r, [IGNORE_INDEX] * 10 + reply_r),
    )
    assert cut_pair(chosen, rejected, max_length=16) == ((chosen, rejected), False)
    assert cut_pair(chosen, rejected, max_length=10) is None, "the prompt alone fills it: no reply to train on"


def test_a_pair_without_a_prompt_keeps_its_replies() -> None:
    chosen, rejected = ([5, 6, 7], [5, 6, 7]), ([8, 9], [8, 9])
    assert cut_pair(chosen, rejected, max_length=2) == ((([5, 6], [5, 6]), ([8, 9], [8, 9])), True)
    assert cut_pair(chosen, rejected, max_length=8) == ((chosen, rejected), False)


def test_a_pair_whose_prompt_fills_max_length_is_dropped_and_counted(tmp_path) -> None:
    tokenizer = tiny_tokenizer()
    rows = [
        {"prompt": "word " * 40, "chosen": " yes", "rejected": " no"},
        {"prompt": "Short?", "chosen": " yes", "rejected": " no"},
    ]
    data, stats = encode(rows, tmp_path, tokenizer, max_length=16)
    assert len(data) == 1 and stats["no_target"] == 1 and stats["skipped_bad"] == 0
    assert data[0]["input_ids"][-1] == tokenizer.eos_token_id, "the short pair kept whole"


def test_pairs_collate_as_the_chosen_rows_then_the_rejected_and_count_as_pairs() -> None:
    pairs = [
        {"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "rejected_input_ids": [1, 4], "rejected_labels": [-100, 4]},
        {
            "input_ids": [5, 6],
            "labels": [-100, 6],
            "rejected_input_ids": [5, 7, 8, 9],
            "rejected_labels": [-100, 7, 8, 9],
        },
    ]
    batch = Collator(pad_id=0, pad_to_multiple_of=1)([[p] for p in pairs])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [5, 6, 0, 0], [1, 4, 0, 0], [5, 7, 8, 9]]
    assert batch["attention_mask"].sum(1).tolist() == [3, 2, 2, 4]
    assert loss_units(batch) == 2, "the step divides a DPO loss by pairs"
    assert batch["target_index"].numel() == 2 + 1 + 1 + 3
    sft = Collator(pad_id=0)([[{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}]])
    assert loss_units(sft) == 2, "and an SFT loss by target tokens"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["objective=dpo"], "objective=dpo trains on pairs: set data.template=preference"),
        (["data=tiny_preference"], "objective=sft cannot train"),
        (["objective=dpo", "data=tiny_preference", "data.batching=packed"], "not packed"),
        (
            ["objective=dpo", "data=tiny_preference", "model.lora=false"],
            "needs model.lora=true: for a full fine-tune set objective.reference=precomputed",
        ),
        (["objective=dpo", "data=tiny_preference", "objective.beta=0"], "objective.beta=0.0 must be positive"),
        (["objective=dpo", "data=tiny_preference", "trainer.best_metric=eval_accuracy"], "not measured under"),
        (["trainer.best_metric=eval_rewards_accuracy"], "not measured under objective=sft"),
        (
            ["objective=dpo", "data=tiny_preference", "data.batching=token_budget", "data.max_tokens_per_batch=300"],
            r"cannot hold a pair at data.max_length=256 \(two sequences: 512 tokens\)",
        ),
    ],
)
def test_the_objective_group_refuses_what_it_cannot_train(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        compose_config(overrides)


def test_the_bundled_preference_data_makes_a_valid_dpo_run() -> None:
    cfg = compose_config(["objective=dpo", "data=tiny_preference", "trainer.best_metric=eval_rewards_accuracy"])
    assert cfg.objective.beta == 0.1 and cfg.data.template == Template.preference
    full = compose_config(
        ["objective=dpo", "data=tiny_preference", "objective.reference=precomputed", "model.lora=false"]
    )
    assert not full.model.lora, "a full fine-tune trains against its precomputed reference"


def test_a_batch_of_pairs_carries_their_precomputed_reference_in_the_order_of_its_rows() -> None:
    pairs = [
        {"input_ids": [1, 2], "labels": [-100, 2], "rejected_input_ids": [1, 4], "rejected_labels": [-100, 4]},
        {"input_ids": [5, 6], "labels": [-100, 6], "rejected_input_ids": [5, 7], "rejected_labels": [-100, 7]},
    ]
    for pair, logps in zip(pairs, ([-1.5, -2.5], [-3.5, -4.5])):
        pair["reference_logps"] = logps
    batch = Collator(pad_id=0, pad_to_multiple_of=1)([[p] for p in pairs])
    assert batch["input_ids"][:, 1].tolist() == [2, 6, 4, 7], "chosen rows, then rejected"
    assert batch["reference_logps"].tolist() == [-1.5, -3.5, -2.5, -4.5]


def test_the_memory_plan_prices_each_micro_batch_of_pairs_as_the_collator_builds_it(capsys, tmp_path) -> None:
    """Every rank's costliest micro-batch the plan simulates, and the eval set's, is the batch the collator makes of
    its pairs: as many rows (both sequences of each pair), as wide, as many trained positions, padded or not; and
    ``ddptrain plan`` prices a DPO run."""
    from ddptrain.data import RowsDataset, build_batching_spec, build_collator, build_datasets
    from ddptrain.plan.__main__ import main as plan
    from ddptrain.plan.at_start import wanted
    from ddptrain.plan.batches import eval_candidate, training_candidates

    dpo = ["objective=dpo", "data=tiny_preference", "plan.device_memory_gb=80", "trainer.device=cpu"]
    cfg = compose_config([*dpo, f"data.cache_dir={tmp_path}"])
    data = build_datasets(cfg.data, tiny_tokenizer(), cfg.trainer.seed)
    spec = build_batching_spec(cfg.data, 2, 1, cfg.trainer.seed)
    candidates = [*training_candidates(data, spec, epochs=2), eval_candidate(data, cfg.data.micro_batch_size, 2, spec)]
    collate = build_collator(cfg.data, pad_id=0)
    for candidate in candidates:
        rows = RowsDataset(data.eval if candidate.where == "eval" else data.train)
        batch = collate([rows[(i,)] for i in candidate.samples])
        shape = candidate.shape
        assert (shape.rows, shape.width) == tuple(batch["input_ids"].shape), candidate.where
        assert shape.targets == batch["target_index"].numel() and shape.pairs == loss_units(batch)
        assert shape.padded == bool((batch["attention_mask"] == 0).any())
    assert wanted(compose_config(dpo)), "a DPO run plans at its start where it has a device size"
    assert plan([*dpo, "--no-levers"]) == 0
    assert "8 pairs, their chosen and rejected sequences 16 x 256 tokens" in capsys.readouterr().out


@pytest.mark.parametrize(
    "batching",
    [[], ["data.pad_to_multiple_of=8", "data.batching=token_budget", "data.max_tokens_per_batch=512"]],
    ids=["length_grouped", "token_budget, padded to 8"],
)
def test_a_collated_batch_of_pairs_never_pads_beyond_what_the_batch_plan_costs_it(batching, tmp_path) -> None:
    """Every micro-batch of an epoch of the bundled pairs on 2 ranks, collated as training collates it: its tensor
    holds no more tokens than the plan's padded cost for it (the plan, the memory plan and the balance use it), and
    no more than data.max_tokens_per_batch."""
    from ddptrain.data import RowsDataset, build_batching_spec, build_collator, build_datasets
    from ddptrain.data.plan import micro_batch_cost
    from ddptrain.data.sampler import DistributedBatchSampler

    cfg = compose_config(["objective=dpo", "data=tiny_preference", f"data.cache_dir={tmp_path}", *batching])
    train = build_datasets(cfg.data, tiny_tokenizer(), cfg.trainer.seed).train
    spec = build_batching_spec(cfg.data, 2, 1, cfg.trainer.seed)
    rows, collate = RowsDataset(train), build_collator(cfg.data, pad_id=0)
    checked = 0
    for rank in (0, 1):
        for batch in DistributedBatchSampler(train["length"], spec, rank):
            collated = collate([rows[row] for row in batch])
            assert collated["input_ids"].numel() <= micro_batch_cost(batch, train["length"], spec)[1]
            assert collated["input_ids"].numel() <= cfg.data.max_tokens_per_batch or not batching
            assert loss_units(collated) == len(batch)
            checked += 1
    assert checked >= 2 * 33


def test_sft_weight_adds_the_chosen_replys_mean_token_loss() -> None:
    """objective.sft_weight=w adds w × the chosen reply's mean token loss, as the SFT loss module computes it."""
    from ddptrain.config import ObjectiveConfig
    from ddptrain.model import CausalLMLoss, build_model
    from ddptrain.model.preference import PreferenceLoss

    cfg = compose_config(["objective=dpo", "data=tiny_preference"])
    tokenizer = tiny_tokenizer()
    pair = {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8], "rejected_input_ids": [5, 6, 9],
            "rejected_labels": [-100, -100, 9]}  # fmt: skip
    batch = Collator(pad_id=tokenizer.pad_token_id)([[pair]])
    causal = build_model(cfg.model, 0, torch.device("cpu"), tokenizer)
    plain, _ = PreferenceLoss(causal, ObjectiveConfig(name="dpo"))(**batch)
    weighted, _ = PreferenceLoss(causal, ObjectiveConfig(name="dpo", sft_weight=0.5))(**batch)
    chosen = Collator(pad_id=tokenizer.pad_token_id)([[{"input_ids": pair["input_ids"], "labels": pair["labels"]}]])
    nll, targets = CausalLMLoss(causal.model)(**chosen)
    assert torch.allclose(weighted - plain, 0.5 * nll / targets, atol=1e-6)


def test_an_eval_prompt_renders_as_the_pairs_were_trained(tmp_path) -> None:
    """trainer.eval_prompts under objective=dpo: a text is a plain pair's prompt, as written; messages go through the
    model's chat template, and a completion stops at its end-of-turn."""
    from ddptrain.data import PromptRenderer

    tokenizer, _ = family("llama3.1")
    data = compose_config(["objective=dpo", "data=tiny_preference"]).data
    renderer = PromptRenderer(data, tokenizer)
    assert renderer.text("Question: 2+2?\nAnswer:") == "Question: 2+2?\nAnswer:"
    messages = PROMPT[1:2]
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert renderer.text({"messages": messages}) == expected
    assert tokenizer.convert_tokens_to_ids("<|eot_id|>") in renderer.stop_ids()


def test_a_base_adapter_must_be_an_adapter_trained_on_the_runs_model(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"holds no adapter_config\.json: name a LoRA adapter folder"):
        compose_config([f"model.base_adapter={tmp_path / 'empty'}"])
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/elsewhere"}))
    expected = r"was trained on /elsewhere, .* set model.name_or_path=/elsewhere model.init=pretrained"
    with pytest.raises(ConfigError, match=expected):
        compose_config([f"model.base_adapter={adapter}"])
    with pytest.raises(ConfigError, match=r"use parallel\.strategy=ddp, not fsdp2"):
        compose_config(["model.init=pretrained", "model.name_or_path=/elsewhere", f"model.base_adapter={adapter}",
                        "parallel.strategy=fsdp2"])  # fmt: skip


def preference_mixture(tmp_path: Path) -> list[str]:
    """The bundled pairs as a mixture of two sources: the first 300 rows as shipped, the other 300 with their own
    field names (question / good / bad), weighted 3:1."""
    rows = [
        json.loads(line) for line in (REPO / "ddptrain" / "assets" / "tiny_preference.jsonl").read_text().splitlines()
    ]
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text("".join(json.dumps(row) + "\n" for row in rows[:300]))
    renamed = [{"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in rows[300:]]
    second.write_text("".join(json.dumps(row) + "\n" for row in renamed))
    sources = (
        f"[{{path: '{first}', weight: 3}}, "
        f"{{path: '{second}', weight: 1, prompt_field: question, chosen_field: good, rejected_field: bad}}]"
    )
    keep = ["data.max_length=256", "data.micro_batch_size=8", "data.eval_fraction=0.1", "data.template=preference"]
    return ["objective=dpo", "data=mixture", f"data.sources={sources}", *keep]


def test_a_mixture_of_preference_sources_reads_each_with_its_own_fields(tmp_path) -> None:
    """data.sources under objective=dpo: each source's pairs with its own field names, the same pairs as one file of
    them all gives, each source's eval share held out; a source of another template is refused."""
    from ddptrain.data import build_datasets

    mixture = compose_config([*preference_mixture(tmp_path), f"data.cache_dir={tmp_path / 'cache'}"])
    data = build_datasets(mixture.data, tiny_tokenizer(), mixture.trainer.seed)
    whole = compose_config(["objective=dpo", "data=tiny_preference", "data.eval_fraction=0"])
    every = build_datasets(whole.data, tiny_tokenizer(), whole.trainer.seed).train
    pairs = {(tuple(r["input_ids"]), tuple(r["rejected_input_ids"])) for r in every}
    mixed = [*data.train, *data.eval]
    assert (
        len(mixed) == len(every) and {(tuple(r["input_ids"]), tuple(r["rejected_input_ids"])) for r in mixed} == pairs
    )
    assert sorted(set(data.train["source"])) == [0, 1] and sorted(set(data.eval["source"])) == [0, 1]
    assert data.epoch_rows is not None, "weighted: each epoch draws its mixture"
    sft_source = "data.sources=[{path: a.jsonl}, {path: b.jsonl, template: alpaca}]"
    with pytest.raises(ConfigError, match=r"data\.sources 1 are not"):
        compose_config(["objective=dpo", "data=mixture", "data.template=preference", sft_source])


def test_the_reference_table_is_keyed_by_what_fixes_the_base_models_numbers_not_by_the_adapter(tmp_path) -> None:
    """objective.reference=precomputed's cache file: the same for another LoRA rank, alpha or checkpointing (the
    reference has its adapter switched off), another for another dtype, attention kernel, head chunking, autocast
    precision, random start, model.base_adapter, or that adapter's files edited in place."""
    from dataclasses import replace

    from ddptrain.config import Attention, DType
    from ddptrain.data import build_datasets
    from ddptrain.model.reference import _cache_path, _model_key

    cfg = compose_config(["objective=dpo", "data=tiny_preference", f"data.cache_dir={tmp_path / 'cache'}"])
    rows = build_datasets(cfg.data, tiny_tokenizer(), cfg.trainer.seed).train
    base = cfg.model

    def path(model=base, seed: int = 0, precision: DType = DType.fp32) -> Path:
        return _cache_path(rows, _model_key(model, seed, precision))

    unchanged = path()
    assert unchanged.parent == Path(rows.cache_files[0]["filename"]).parent, "beside the tokenized rows"
    for changes in ({"lora_rank": 8}, {"lora_alpha": 64}, {"gradient_checkpointing": True}):
        assert path(replace(base, **changes)) == unchanged, changes
    others = [path(seed=1), path(precision=DType.bf16)]
    for changes in ({"dtype": DType.bf16}, {"attn_implementation": Attention.eager}, {"loss_chunk_tokens": 0}):
        others.append(path(replace(base, **changes)))
    adapter = tmp_path / "sft" / "best"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(b"1234")
    others.append(path(replace(base, base_adapter=str(adapter))))
    (adapter / "adapter_model.safetensors").write_bytes(b"12345")  # retrained in place
    others.append(path(replace(base, base_adapter=str(adapter))))
    assert len({unchanged, *others}) == len(others) + 1, "each change has a table of its own"
