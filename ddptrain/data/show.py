"""Showing tokenized samples: the text as the model sees it, with the trained tokens marked.

Used by ``python -m ddptrain.preview`` (terminal text and an HTML page) and by the run log, which prints the first
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


def marked_text(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], labels: Sequence[int], colour: bool) -> str:
    """The decoded text, each trained run in green (``colour``) or between ``[[`` and ``]]``."""
    start, end = (GREEN, RESET) if colour else (OPEN, CLOSE)
    pieces = []
    for run, trained in runs(ids, labels):
        text = tokenizer.decode(run, skip_special_tokens=False)
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
        tokens = "".join(_token_span(tokenizer, token, label) for token, label in zip(ids, labels))
        body.append(f'<h2>{html.escape(heading)}</h2>\n<div class="sample">{tokens}</div>')
    return (
        '<!doctype html>\n<html><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{PAGE_STYLE}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def _token_span(tokenizer: PreTrainedTokenizerBase, token: int, label: int) -> str:
    text = tokenizer.decode([token], skip_special_tokens=False)
    classes = "tok trained" if label != IGNORE_INDEX else "tok"
    hover = html.escape(f"{token}: {text!r}", quote=True)
    return f'<span class="{classes}" data-id="{token}" title="{hover}">{html.escape(text)}</span>'
