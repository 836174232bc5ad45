"""Showing tokenized samples: the text as the model sees it, with the trained tokens marked.

Used by ``ddptrain preview`` (terminal text and an HTML page) and by the run log, which prints the first
training sample at start. A token is trained when its label is not ``IGNORE_INDEX``. No torch in this module.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ddptrain.data.encode import IGNORE_INDEX

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

OPEN, CLOSE = "[[", "]]"  # around trained text where colour is not available
GREEN, RESET = "\x1b[1;32m", "\x1b[0m"


def runs(ids: Sequence[int], labels: Sequence[int]) -> list[tuple[list[int], bool]]:
    """Consecutive tokens grouped by whether they are trained: ``[(ids, trained), ...]`` in order."""
    grouped: list[tuple[list[int], bool]] = []
    for token, label in zip(ids, labels):
        trained = label != IGNORE_INDEX
        if grouped and grouped[-1][1] == trained:
            grouped[-1][0].append(token)
        else:
            grouped.append(([token], trained))
    return grouped


CONTEXT_TOKENS = 8  # tokens decoded before each one: a character split over tokens, a word's leading space


def token_texts(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> list[str]:
    """The text each token adds to the decoded sequence. Decoding tokens one by one would drop SentencePiece's
    leading spaces and split multi-byte characters; each token is decoded after a few before it instead, and its
    text is what it adds to theirs."""
    texts = []
    for k, token in enumerate(ids):
        context = list(ids[max(0, k - CONTEXT_TOKENS) : k])
        before = tokenizer.decode(context, skip_special_tokens=False)
        after = tokenizer.decode([*context, token], skip_special_tokens=False)
        texts.append(after[len(before) :] if after.startswith(before) else tokenizer.decode([token]))
    return texts


def marked_text(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], labels: Sequence[int], colour: bool) -> str:
    """The decoded text, each trained run in green (``colour``) or between ``[[`` and ``]]``."""
    start, end = (GREEN, RESET) if colour else (OPEN, CLOSE)
    pieces, texts = [], iter(token_texts(tokenizer, ids))
    for run, trained in runs(ids, labels):
        text = "".join(next(texts) for _ in run)
        pieces.append(f"{start}{text}{end}" if trained else text)
    return "".join(pieces)


def describe(row: dict[str, Any], max_length: int, sources: Sequence[str] | None = None) -> str:
    """One line on a tokenized row: its tokens, how many are trained, whether it reaches data.max_length, and for a
    mixture the source it came from."""
    n, trained = len(row["input_ids"]), sum(label != IGNORE_INDEX for label in row["labels"])
    parts = [f"{n} tokens, {trained} trained ({trained / max(n, 1):.0%})"]
    if n >= max_length:
        parts.append(f"at data.max_length={max_length}: longer rows are cut there")
    if sources is not None and "source" in row:
        parts.append(f"from data.sources[{row['source']}] ({sources[row['source']]})")
    return " · ".join(parts)


PAGE_STYLE = """
body { font-family: ui-monospace, monospace; margin: 2em; }
h2 { font-size: 1em; margin-top: 2em; }
.sample { white-space: pre-wrap; line-height: 1.6; border: 1px solid #ddd; padding: 0.5em; }
.tok:hover { outline: 1px solid #555; }
.trained { background: #b7e4b0; }
.legend .trained { padding: 0 0.3em; }
"""


def html_page(title: str, samples: list[tuple[str, list[int], list[int]]], tokenizer: PreTrainedTokenizerBase) -> str:
    """A page of samples, one ``<span class="tok">`` per token (its id and text on hover), trained tokens highlighted.

    Args:
        title: the page's heading.
        samples: ``(heading, input_ids, labels)`` for each sample.
        tokenizer: decodes each token.
    """
    body = [f"<h1>{html.escape(title)}</h1>", '<p class="legend"><span class="trained">highlighted</span>: trained</p>']
    for heading, ids, labels in samples:
        pieces = zip(ids, labels, token_texts(tokenizer, ids), tokenizer.convert_ids_to_tokens(list(ids)))
        tokens = "".join(_token_span(*piece) for piece in pieces)
        body.append(f'<h2>{html.escape(heading)}</h2>\n<div class="sample">{tokens}</div>')
    return (
        '<!doctype html>\n<html><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{PAGE_STYLE}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def _token_span(token: int, label: int, text: str, piece: str) -> str:
    classes = "tok trained" if label != IGNORE_INDEX else "tok"
    hover = html.escape(f"{token}: {piece!r}", quote=True)  # the vocabulary's own spelling of the token
    return f'<span class="{classes}" data-id="{token}" title="{hover}">{html.escape(text)}</span>'
