"""Build the assets ddptrain ships in ddptrain/assets (run once; the outputs are committed).

    python scripts/make_assets.py --qwen2-tokenizer ../shared/data/tokenizers/qwen2 \
        --model-configs ../shared/data/model_configs

Makes:
- ``tiny_tokenizer/``: the Qwen2 byte-level BPE cut to its first 4,000 merges (4,259 tokens
  with the three special tokens). Ordinary English still encodes to sensible sub-words, and
  the tiny model's embedding stays small. Qwen2's tokenizer is Apache-2.0.
- ``tiny_instruct.jsonl`` / ``tiny_chat.jsonl`` / ``tiny_preference.jsonl``: procedurally generated instruction
  data and preference pairs (an answer preferred to a refusal)
  (sorting, reversing, arithmetic, counting, ...), written by this script, free to redistribute.
  Lengths vary on purpose (short answers to long lists) so that batching has work to do.
- ``model_configs/``: copies of the Qwen2.5-0.5B and -7B architecture configs (no weights).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "ddptrain" / "assets"
TINY_MERGES = 4000
N_BYTES = 256  # Qwen2's vocab starts with the 256 byte symbols, then one token per merge, in order

WORDS = """apple river stone cloud green quick silver garden window mountain bread candle
forest music ocean paper rabbit summer winter yellow orange purple light heavy small large
happy bright quiet loud morning evening simple modern ancient gentle brave clever friendly
teacher doctor farmer painter writer dancer sailor pilot baker singer student engineer
table chair bottle pencil basket ladder mirror blanket pillow kettle bucket hammer
north south east west spring autumn valley island desert meadow harbor bridge castle
tiger eagle dolphin turtle falcon badger otter beaver pigeon sparrow salmon lizard
red blue black white brown golden pink grey violet amber coral ivory
run jump read write sing dance build paint carry climb swim travel""".split()


def make_tokenizer(qwen2_dir: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    source = AutoTokenizer.from_pretrained(str(qwen2_dir))
    vocab = json.loads((qwen2_dir / "vocab.json").read_text())
    by_id = {i: tok for tok, i in vocab.items()}
    merges = [
        line for line in (qwen2_dir / "merges.txt").read_text().splitlines() if line and not line.startswith("#version")
    ]
    tiny_vocab = {by_id[i]: i for i in range(N_BYTES + TINY_MERGES)}
    for i, merge in enumerate(merges[:TINY_MERGES]):
        assert "".join(merge.split(" ")) == by_id[N_BYTES + i], f"merge {i} does not produce token {N_BYTES + i}"
    spec = json.loads(source.backend_tokenizer.to_str())
    spec["model"]["vocab"] = tiny_vocab
    spec["model"]["merges"] = [m.split(" ") for m in merges[:TINY_MERGES]]
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    spec["added_tokens"] = [
        {
            "id": len(tiny_vocab) + k,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for k, tok in enumerate(special)
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _words(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(n)]


def _numbers(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(0, 999) for _ in range(n)]


def make_example(rng: random.Random) -> dict[str, str]:
    """One instruction row; list sizes are drawn log-uniformly so lengths spread widely."""
    n = int(2 ** rng.uniform(1, 5.8))
    task = rng.randrange(8)
    if task == 0:
        words = _words(rng, n)
        return {
            "instruction": "Reverse the order of these words.",
            "input": " ".join(words),
            "output": " ".join(reversed(words)),
        }
    if task == 1:
        nums = _numbers(rng, n)
        return {
            "instruction": "Sort these numbers from smallest to largest.",
            "input": ", ".join(map(str, nums)),
            "output": ", ".join(map(str, sorted(nums))),
        }
    if task == 2:
        a, b = rng.randint(0, 9999), rng.randint(0, 9999)
        return {"instruction": "Add the two numbers.", "input": f"{a} + {b}", "output": f"{a} + {b} = {a + b}"}
    if task == 3:
        words = _words(rng, n)
        return {
            "instruction": "Write the sentence in capital letters.",
            "input": " ".join(words),
            "output": " ".join(words).upper(),
        }
    if task == 4:
        words = _words(rng, n)
        return {
            "instruction": "How many words are in the text?",
            "input": " ".join(words),
            "output": f"The text has {len(words)} words.",
        }
    if task == 5:
        word = rng.choice(WORDS)
        k = min(n, 30)
        return {"instruction": f"Repeat the word '{word}' {k} times.", "input": "", "output": " ".join([word] * k)}
    if task == 6:
        k = min(n, 40)
        return {
            "instruction": f"List the first {k} even numbers.",
            "input": "",
            "output": ", ".join(str(2 * i) for i in range(k)),
        }
    word = rng.choice(WORDS)
    return {"instruction": f"Spell the word '{word}' letter by letter.", "input": "", "output": "-".join(word)}


def make_chat(rng: random.Random) -> dict[str, list[dict[str, str]]]:
    messages = [{"role": "system", "content": "You are a careful assistant."}]
    for _ in range(rng.randint(1, 3)):
        ex = make_example(rng)
        question = ex["instruction"] + (f"\n{ex['input']}" if ex["input"] else "")
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": ex["output"]}]
    return {"messages": messages}


# A toy preference: an answer is preferred to a refusal (learnable from the replies' words, so a model of the
# bundled size gets held-out pairs right; README: "Preference training (DPO)").
REFUSALS = [
    " I'm sorry, but I can't help with that.",
    " As an AI, I cannot answer this question.",
    " Sorry, I am unable to do that task.",
    " I cannot assist with this request.",
]


def make_preference(rng: random.Random) -> dict[str, str]:
    ex = make_example(rng)
    question = ex["instruction"] + (f"\n{ex['input']}" if ex["input"] else "")
    return {"prompt": f"Question: {question}\nAnswer:", "chosen": f" {ex['output']}", "rejected": rng.choice(REFUSALS)}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qwen2-tokenizer", type=Path, required=True)
    parser.add_argument("--model-configs", type=Path, required=True)
    args = parser.parse_args()
    make_tokenizer(args.qwen2_tokenizer, ASSETS / "tiny_tokenizer")
    rng = random.Random(1234)
    write_jsonl(ASSETS / "tiny_instruct.jsonl", [make_example(rng) for _ in range(4000)])
    write_jsonl(ASSETS / "tiny_chat.jsonl", [make_chat(rng) for _ in range(600)])
    write_jsonl(ASSETS / "tiny_preference.jsonl", [make_preference(rng) for _ in range(600)])
    for name in ("qwen2.5-0.5b", "qwen2.5-7b"):
        (ASSETS / "model_configs" / name).mkdir(parents=True, exist_ok=True)
        shutil.copy(args.model_configs / name / "config.json", ASSETS / "model_configs" / name / "config.json")


if __name__ == "__main__":
    main()
