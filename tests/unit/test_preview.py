"""``python -m ddptrain.preview``: the samples as the model sees them, trained tokens marked where the labels say.

The oracle is the tokenized rows a run trains on (``build_datasets`` on the same config): the marked text must
show exactly the runs of tokens whose label is not IGNORE_INDEX, and the HTML page one element per token, marked
the same way.
"""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from ddptrain import preview
from ddptrain.config.hydra import ASSETS_DIR
from ddptrain.data import IGNORE_INDEX
from ddptrain.data.mixture import build_datasets
from ddptrain.model import build_tokenizer
from tests.conftest import compose_config

# A ChatML-shaped template the bundled tokenizer can render: the chat rows go through the chat-template path.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chat_rows(n: int) -> list[dict]:
    return [json.loads(line) for line in (ASSETS_DIR / "tiny_chat.jsonl").read_text().splitlines()[:n]]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def data_overrides(kind: str, tmp_path: Path) -> list[str]:
    """The data settings of each case, on the bundled data (or files made from it)."""
    if kind == "alpaca":
        return ["data=tiny_instruct"]
    if kind == "chat":
        template = tmp_path / "chatml.jinja"
        template.write_text(CHATML)
        return ["data=tiny_chat", f"data.chat_template={template}"]
    if kind == "sharegpt":
        speaker = {"system": "system", "user": "human", "assistant": "gpt"}
        rows = [
            {"conversations": [{"from": speaker[m["role"]], "value": m["content"]} for m in row["messages"]]}
            for row in chat_rows(60)
        ]
        return [f"data.path={write_jsonl(tmp_path / 'sharegpt.jsonl', rows)}", "data.template=sharegpt"]
    if kind == "text":
        rows = [{"text": m["content"]} for row in chat_rows(60) for m in row["messages"] if m["role"] == "assistant"]
        return [f"data.path={write_jsonl(tmp_path / 'text.jsonl', rows)}", "data.template=text"]
    sources = f"[{{path: {ASSETS_DIR / 'tiny_instruct.jsonl'}, max_rows: 80}}, {{path: {ASSETS_DIR / 'tiny_chat.jsonl'}, template: chat, max_rows: 40}}]"  # noqa: E501
    return ["data=mixture", f"data.sources={sources}"]


def trained_runs(tokenizer, ids: list[int], labels: list[int]) -> list[str]:
    """Each unbroken run of tokens whose label is not IGNORE_INDEX, decoded (computed here, from the labels)."""
    runs, current = [], []
    for token, label in zip(ids, labels):
        if label != IGNORE_INDEX:
            current.append(token)
        elif current:
            runs, current = [*runs, current], []
    runs += [current] if current else []
    return [tokenizer.decode(run, skip_special_tokens=False) for run in runs]


class TokenSpans(HTMLParser):
    """Per sample block: ``[(token id, highlighted), ...]`` from the page's token elements."""

    def __init__(self):
        super().__init__()
        self.samples: list[list[tuple[int, bool]]] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "div" and attrs.get("class") == "sample":
            self.samples.append([])
        elif tag == "span" and "tok" in attrs.get("class", "").split():
            self.samples[-1].append((int(attrs["data-id"]), "trained" in attrs["class"].split()))


@pytest.mark.parametrize("kind", ["alpaca", "chat", "sharegpt", "text", "mixture"])
def test_the_preview_marks_exactly_the_tokens_the_labels_train(kind, tmp_path, datasets_cache, capsys) -> None:
    overrides = [*data_overrides(kind, tmp_path), f"data.cache_dir={datasets_cache}", "data.max_length=256"]
    cfg = compose_config(overrides)
    tokenizer = build_tokenizer(cfg.model)
    train = build_datasets(cfg.data, tokenizer, cfg.trainer.seed).train
    rows = [0, 1, len(train) - 1]  # in a mixture the last row comes from the last source
    page = tmp_path / "preview.html"
    assert preview.main([*overrides, "--rows", ",".join(map(str, rows)), "--html", str(page)]) == 0
    printed = capsys.readouterr().out

    shown = printed[: printed.index("batch plan, epoch 0:")]
    blocks = re.split(r"^── training row \d+ · .*$", shown, flags=re.M)[1:]
    assert len(blocks) == len(rows), printed[:2000]
    for block, i in zip(blocks, rows):
        ids, labels = train[i]["input_ids"], train[i]["labels"]
        text = block[1:-2]  # print(heading), print(text), print()
        assert re.findall(r"\[\[(.*?)\]\]", text, flags=re.S) == trained_runs(tokenizer, ids, labels)
        assert text.replace("[[", "").replace("]]", "") == tokenizer.decode(ids, skip_special_tokens=False)
    headings = re.findall(r"^── training row (\d+) · (\d+) tokens, (\d+) trained", printed, flags=re.M)
    counts = [(len(train[i]["labels"]), sum(label != IGNORE_INDEX for label in train[i]["labels"])) for i in rows]
    assert headings == [(str(i), str(n), str(trained)) for i, (n, trained) in zip(rows, counts)]
    if kind == "mixture":
        assert re.findall(r"from data\.sources\[(\d)\]", printed) == [str(train[i]["source"]) for i in rows]

    parsed = TokenSpans()
    parsed.feed(page.read_text())
    assert parsed.samples == [
        [(t, label != IGNORE_INDEX) for t, label in zip(train[i]["input_ids"], train[i]["labels"])] for i in rows
    ]


def test_a_mistyped_key_or_a_row_outside_the_training_set_is_named(tmp_path, datasets_cache, capsys) -> None:
    assert preview.main(["data.max_lenght=64"]) == 2
    assert "ddptrain.preview: invalid configuration" in capsys.readouterr().err
    data = [*data_overrides("text", tmp_path), f"data.cache_dir={datasets_cache}"]
    assert preview.main([*data, "--rows", "2,100000"]) == 1
    assert "--rows: the training set has rows 0 to " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        preview.main([*data, "--rows", "two"])
    assert "--rows two: give row numbers from 0" in capsys.readouterr().err


PLAN_ROW = re.compile(r"^ +(\d+) +(\d+) +(\d+) +(\d+) +(\d+) +([\d.]+)% +(\d+)$", flags=re.M)


@pytest.mark.parametrize(
    "batching",
    [
        ["data.batching=length_grouped", "data.micro_batch_size=6"],
        ["data.batching=token_budget", "data.max_tokens_per_batch=1024", "data.pad_to_multiple_of=8"],
        ["data.batching=packed", "data.max_tokens_per_batch=512"],
    ],
    ids=["length_grouped", "token_budget", "packed"],
)
def test_the_batch_plan_is_what_the_loader_hands_each_rank_in_epoch_0(batching, datasets_cache, capsys) -> None:
    """Per rank, the preview's micro-batches, samples, tokens, padded tokens, padding and costliest micro-batch are
    what the run's sampler, collator and loader hand that rank in epoch 0, counted on the collated tensors (samples
    as rows, or as the position restarts of a packed row; tokens as the attended positions); the samples left out
    are those no rank got."""
    from torch.utils.data import DataLoader

    from ddptrain.data.collate import RowsDataset, build_collator
    from ddptrain.data.loader import build_batching_spec
    from ddptrain.data.sampler import DistributedBatchSampler

    overrides = [*batching, "data.max_rows=300", "data.max_length=256", "optim.grad_accum_steps=2"]
    overrides += [f"data.cache_dir={datasets_cache}"]
    assert preview.main([*overrides, "--n", "1", "--world-size", "2"]) == 0
    printed = capsys.readouterr().out
    shown = [tuple(float(x) if "." in x else int(x) for x in row) for row in PLAN_ROW.findall(printed)]
    left_out = int(re.search(r"(\d+) sample\(s\) left out of this epoch", printed).group(1))

    cfg = compose_config(overrides)
    tokenizer = build_tokenizer(cfg.model)
    data = build_datasets(cfg.data, tokenizer, cfg.trainer.seed)
    spec = build_batching_spec(cfg.data, 2, cfg.optim.grad_accum_steps, cfg.trainer.seed)
    counted, seen = [], 0
    for rank in (0, 1):
        sampler = DistributedBatchSampler(data.train["length"], spec, rank, data.epoch_rows)
        loader = DataLoader(RowsDataset(data.train), batch_sampler=sampler, collate_fn=build_collator(cfg.data, 0))
        batches = list(loader)
        packed = "position_ids" in batches[0]
        samples = sum(int((b["position_ids"] == 0).sum()) if packed else len(b["input_ids"]) for b in batches)
        tokens = sum(b["input_ids"].numel() if packed else int(b["attention_mask"].sum()) for b in batches)
        padded = sum(b["input_ids"].numel() for b in batches)
        costliest = max(b["input_ids"].numel() for b in batches)
        # The padding as printed: a percentage to one decimal.
        counted.append((rank, len(batches), samples, tokens, padded, round(100 * (1 - tokens / padded), 1), costliest))
        seen += samples
    assert shown == counted, f"the preview printed {shown}, the loader handed {counted}"
    assert left_out == len(data.train) - seen
    if "data.batching=packed" not in batching:
        assert all(row[5] > 0 for row in counted), "the padding must be something to count"
