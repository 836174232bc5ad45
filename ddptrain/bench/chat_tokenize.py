"""Tokenizing speed of conversations: the model's own chat template against ChatML pieces.

    python -m ddptrain.bench.chat_tokenize --data ../shared/data/alpaca/alpaca_data_52k.jsonl \\
        --tokenizer ../shared/data/tokenizers/qwen2 --rows 10000

Alpaca rows become conversations (``data.template=chat``): one exchange (the instruction, with its input, as the
user's message; the output as the reply), and two exchanges (two rows in one conversation). Each is tokenized cold
(an empty ``datasets`` cache) through the tokenizer's own chat template (the whole conversation rendered,
each reply's span found) and once as ChatML pieces (``data.chat_template=chatml``, no template rendered). Qwen2's
template is ChatML itself, so both give the same conversation and only the path differs. Prints a markdown table for
``bench/README.md``: milliseconds per conversation (the fastest of ``--repeats`` interleaved runs of each path) and
the template path's ratio to the ChatML path.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from ddptrain.config import DataConfig, ModelConfig, Template
from ddptrain.data import build_datasets
from ddptrain.model import build_tokenizer


def exchange(row: dict) -> list[dict[str, str]]:
    prompt = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]


def write_conversations(data: Path, rows: int, turns: int, folder: Path) -> Path:
    """``rows`` conversations of ``turns`` exchanges each, from consecutive Alpaca rows."""
    source = [json.loads(line) for line in data.read_text().splitlines()[: rows * turns]]
    path = folder / f"chat-{turns}.jsonl"
    with path.open("w") as f:
        for start in range(0, len(source) - turns + 1, turns):
            messages = [m for row in source[start : start + turns] for m in exchange(row)]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def cold_seconds(path: Path, tokenizer, chat_template: str | None, workdir: Path) -> tuple[float, int]:
    cache = tempfile.mkdtemp(prefix="cache-", dir=workdir)
    cfg = DataConfig(
        path=str(path),
        template=Template.chat,
        chat_template=chat_template,
        max_length=4096,
        eval_fraction=0.0,
        cache_dir=cache,
    )
    build_datasets(DataConfig(path=str(path), template=Template.chat, cache_dir=cache, max_rows=1), tokenizer, 0)
    started = time.perf_counter()  # the JSON is already in Arrow: what is timed is the encoding
    data = build_datasets(cfg, tokenizer, seed=0)
    return time.perf_counter() - started, len(data.train)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="an Alpaca-format .jsonl file")
    parser.add_argument("--tokenizer", required=True, help="a tokenizer folder with a chat template")
    parser.add_argument("--rows", type=int, default=10000, help="conversations per workload")
    parser.add_argument("--repeats", type=int, default=3, help="cold runs of each path, the fastest kept")
    args = parser.parse_args(argv)
    tokenizer = build_tokenizer(ModelConfig(tokenizer=args.tokenizer))
    print("| conversation | conversations | chat template (ms each) | ChatML pieces (ms each) | ratio |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for turns in (1, 2):
            path = write_conversations(args.data, args.rows, turns, workdir)
            # Interleaved, the fastest of the repeats each: noise on a shared machine only slows a run.
            timed = [
                (cold_seconds(path, tokenizer, None, workdir), cold_seconds(path, tokenizer, "chatml", workdir))
                for _ in range(args.repeats)
            ]
            template_s, n = min(t for t, _ in timed)
            chatml_s, n_chatml = min(c for _, c in timed)
            # Rows with only empty replies are dropped by the template path (nothing to train) and kept by ChatML's
            # (its end-of-turn is trained): each path's time is divided by its own count.
            template_ms, chatml_ms = template_s / n * 1e3, chatml_s / n_chatml * 1e3
            label = "one exchange" if turns == 1 else "two exchanges"
            print(f"| {label} | {n} | {template_ms:.3f} | {chatml_ms:.3f} | {template_ms / chatml_ms:.2f}x |")


if __name__ == "__main__":
    main()
