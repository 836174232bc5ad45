"""Time to prepare training data: read, format and tokenize, cold (empty cache) and cached.

    python -m ddptrain.bench.data_prep --data ../shared/data/alpaca/alpaca_data_52k.jsonl \\
        --tokenizer ../shared/data/tokenizers/qwen2 --num-proc 1 2

Two workloads, each with ``data.num_proc`` = every value given:

- ``alpaca``: the file as ``data=alpaca`` reads it.
- ``mixture x4``: four copies of the file, each row's instruction marked with its copy's number so
  that nothing is shared between them, read as a ``data.sources`` mixture without weights.

"cold" starts from an empty ``datasets`` cache (the JSON is parsed to Arrow, then tokenized);
"cached" runs the same build again on that cache (what every later run and every other node-local
rank does). Prints a markdown table for ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from ddptrain.config import DataConfig, ModelConfig, SourceConfig
from ddptrain.data import build_datasets
from ddptrain.model import build_tokenizer

COPIES = 4


def write_copies(data: Path, folder: Path) -> list[Path]:
    """``COPIES`` versions of the file whose rows differ (a marked instruction), so no cache is shared."""
    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    paths = []
    for k in range(COPIES):
        path = folder / f"copy{k}.jsonl"
        path.write_text(
            "".join(json.dumps({**row, "instruction": f"[{k}] {row['instruction']}"}) + "\n" for row in rows)
        )
        paths.append(path)
    return paths


def timed_build(cfg: DataConfig, tokenizer) -> tuple[float, int]:
    started = time.perf_counter()
    data = build_datasets(cfg, tokenizer, seed=0)
    return time.perf_counter() - started, len(data.train)


def measure(name: str, cfg_for_cache, tokenizer, num_proc: int, workdir: Path) -> dict:
    cache = Path(tempfile.mkdtemp(prefix=f"cache-{num_proc}-", dir=workdir))
    cfg = cfg_for_cache(str(cache), num_proc)
    cold, rows = timed_build(cfg, tokenizer)
    cached, _ = timed_build(cfg, tokenizer)
    return {"workload": name, "rows": rows, "num_proc": num_proc, "cold_s": cold, "cached_s": cached}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="an Alpaca .jsonl file")
    parser.add_argument("--tokenizer", required=True, help="tokenizer folder")
    parser.add_argument("--num-proc", type=int, nargs="+", default=[1, 2], help="data.num_proc values to time")
    parser.add_argument("--max-length", type=int, default=2048)
    args = parser.parse_args(argv)

    tokenizer = build_tokenizer(ModelConfig(tokenizer=args.tokenizer))
    results = []
    with tempfile.TemporaryDirectory(prefix="ddptrain-data-prep-") as tmp:
        workdir = Path(tmp)
        copies = write_copies(args.data, workdir)
        alpaca = lambda cache, n: DataConfig(  # noqa: E731
            path=str(args.data), max_length=args.max_length, cache_dir=cache, num_proc=n
        )
        sources = [SourceConfig(path=str(p)) for p in copies]
        mixture = lambda cache, n: DataConfig(  # noqa: E731
            path=None, sources=sources, max_length=args.max_length, cache_dir=cache, num_proc=n
        )
        for num_proc in args.num_proc:
            results.append(measure("alpaca", alpaca, tokenizer, num_proc, workdir))
            results.append(measure(f"mixture x{COPIES}", mixture, tokenizer, num_proc, workdir))
    print("| workload | training rows | data.num_proc | cold (s) | cached (s) | cold rows/s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        rate = r["rows"] / r["cold_s"]
        cells = [r["workload"], r["rows"], r["num_proc"], f"{r['cold_s']:.1f}", f"{r['cached_s']:.2f}", f"{rate:,.0f}"]
        print("| " + " | ".join(str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
