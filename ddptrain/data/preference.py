"""Preference pairs (``data.template=preference``, ``objective=dpo``): a row becomes a chosen and a rejected
sequence that share their prompt, each labelled on its reply alone.

A row holds ``prompt``, ``chosen`` and ``rejected`` (``data.prompt_field`` etc.) in one of three shapes:

- plain text: the prompt and each reply as strings; each sequence is the prompt's tokens, the reply's and the EOS
  (no BOS, as for the other plain templates);
- messages: the prompt as a list of ``{role, content}`` messages (or a string: one user message), each reply as a
  string or an assistant message; each sequence is the chat template applied to the prompt's messages and the reply,
  token for token what ``apply_chat_template`` gives (one BOS, one system prompt), trained on the reply and its
  end-of-turn;
- whole conversations: ``chosen`` and ``rejected`` are conversations that differ only in their last (assistant)
  message, as Hub datasets ship them (a ``prompt`` beside them, as UltraFeedback has, only repeats their start).

Truncation comes before collation, per pair: the prompt is cut from the left first (both sequences alike, keeping
at least one prompt token), then whichever reply is still too long from the right. A pair whose prompt alone fills
``data.max_length`` is dropped, and counted with the rows that have nothing to train on. The row's ``length``,
which the batch plan costs it at, is twice its longer sequence rounded up to ``data.pad_to_multiple_of``: the
collator pads both sequences to one width.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ddptrain.config import DataConfig, Template
from ddptrain.data.batch_cost import round_up
from ddptrain.data.encode import IGNORE_INDEX, RowEncoder, _no_target, skip_or_refuse
from ddptrain.data.templates import RowError, chatml_turns, render_chat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Sequence = tuple[list[int], list[int]]  # input_ids, labels
COLUMNS = ("input_ids", "labels", "rejected_input_ids", "rejected_labels", "length", "truncated", "bad", "no_target")


class PairEncoder:
    """Turns preference rows into ``input_ids``/``labels`` (chosen) and ``rejected_input_ids``/``rejected_labels``.

    The same interface as ``RowEncoder`` (``datasets.map`` calls it on a batch of rows); conversations are rendered
    by a ``RowEncoder`` for chat rows, so that the two templates' handling (the tokenizer's own or
    ``data.chat_template``, ChatML without one, an EOS inserted where the template writes none) is one code.
    """

    def __init__(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase):
        self.cfg = cfg
        # Untruncated sequences: the pair is cut as a pair (``cut_pair``).
        self.rows = RowEncoder(replace(cfg, template=Template.chat, max_length=2**31 - 1), tokenizer)
        self.chat_template = self.rows.chat_template

    def sequences(self, row: Mapping[str, Any]) -> tuple[Sequence, Sequence]:
        """The chosen and the rejected sequence of one row, untruncated.

        Raises:
            RowError: a field is missing or malformed, or a reply is empty.
        """
        prompt, chosen, rejected = self._parts(row)
        if isinstance(prompt, str):  # plain text: prompt and reply tokenized apart, the EOS after the reply
            (c_ids, c_labels, _), (r_ids, r_labels, _) = self.rows.encode_turns(
                [[(prompt, chosen)], [(prompt, rejected)]]
            )
            return (c_ids, c_labels), (r_ids, r_labels)
        return self._conversation([*prompt, chosen]), self._conversation([*prompt, rejected])

    def _parts(self, row: Mapping[str, Any]) -> tuple[Any, Any, Any]:
        """(prompt, chosen, rejected): three strings, or a message list and two assistant messages."""
        c = self.cfg
        chosen, rejected, prompt = row.get(c.chosen_field), row.get(c.rejected_field), row.get(c.prompt_field)
        conversations = isinstance(chosen, list) and isinstance(rejected, list) and max(len(chosen), len(rejected)) > 1
        if conversations:  # whole conversations: they carry the prompt (a prompt field beside them only repeats it)
            prompt, chosen, rejected = _split_conversations(chosen, rejected, c.chosen_field, c.rejected_field)
        plain = isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str)
        if plain:
            for name, value in ((c.chosen_field, chosen), (c.rejected_field, rejected)):
                if not value.strip():
                    raise RowError(f"field '{name}' is empty: a pair needs two replies")
            return prompt, chosen, rejected
        messages = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _messages(prompt, c.prompt_field)
        )
        return messages, _reply(chosen, c.chosen_field), _reply(rejected, c.rejected_field)

    def _conversation(self, messages: list[dict[str, str]]) -> Sequence:
        """The conversation as the chat template writes it, trained on its last (assistant) message alone."""
        if self.chat_template is None:  # ChatML pieces: everything before the last reply is prompt
            turns = chatml_turns(messages)
            prompt = "".join(p + r for p, r in turns[:-1]) + turns[-1][0]
            ((ids, labels, _),) = self.rows.encode_turns([[(prompt, turns[-1][1])]])
            return ids, labels
        text, spans, eos_after = render_chat(messages, self.rows.render, self.rows.token_ends)
        last = len(spans) - 1
        ((ids, labels, _),) = self.rows.encode_texts([(text, spans[last:], (0,) if last in eos_after else ())])
        return ids, labels

    def __call__(
        self, batch: dict[str, list], indices: list[int], source: str, key: str = "data.path"
    ) -> dict[str, list]:
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        out: dict[str, list] = {k: [] for k in COLUMNS}
        for index, row in zip(indices, rows):
            try:
                cut = cut_pair(*self.sequences(row), self.cfg.max_length)
            except RowError as err:
                skip_or_refuse(err, self.cfg.skip_bad_rows, source, index, key)
                cut, bad = None, True
            else:
                bad = False
            (chosen, rejected), truncated = cut or ((([], []), ([], [])), False)  # None: no reply fits after the prompt
            out["input_ids"].append(chosen[0])
            out["labels"].append(chosen[1])
            out["rejected_input_ids"].append(rejected[0])
            out["rejected_labels"].append(rejected[1])
            out["length"].append(2 * round_up(max(len(chosen[0]), len(rejected[0])), self.cfg.pad_to_multiple_of))
            out["truncated"].append(truncated)
            out["bad"].append(bad)
            out["no_target"].append(not bad and (cut is None or _no_target(chosen[1]) or _no_target(rejected[1])))
        return out


def cut_pair(chosen: Sequence, rejected: Sequence, max_length: int) -> tuple[tuple[Sequence, Sequence], bool] | None:
    """The pair within ``max_length`` tokens per sequence, and whether it was cut: the shared prompt cut from the left
    first (keeping at least one token, so that the reply's first token is still predicted), then each sequence from
    the right. None when the prompt alone fills ``max_length``: no reply would be trained on."""
    prompt = min(_first_target(chosen[1]), _first_target(rejected[1]))
    if prompt >= max_length:
        return None
    longest = max(len(chosen[0]), len(rejected[0]))
    cut = max(min(longest - max_length, prompt - 1), 0)
    pair = tuple((ids[cut:][:max_length], labels[cut:][:max_length]) for ids, labels in (chosen, rejected))
    return pair, longest > max_length  # type: ignore[return-value]


def _first_target(labels: list[int]) -> int:
    return next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))


def _messages(value: Any, field: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not all(
        isinstance(m, Mapping) and {"role", "content"} <= m.keys() for m in value
    ):
        raise RowError(f"field '{field}' must be a text or a list of {{role, content}} messages")
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in value]


def _reply(value: Any, field: str) -> dict[str, str]:
    """A reply as an assistant message: a string, one message, or a one-message list."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, Mapping):
        if value.get("role", "assistant") != "assistant" or "content" not in value:
            raise RowError(f"field '{field}' must be an assistant message ({{role: assistant, content}})")
        value = value["content"]
    if not isinstance(value, str) or not value.strip():
        raise RowError(f"field '{field}' must be a non-empty reply (a text or an assistant message)")
    return {"role": "assistant", "content": value}


def _split_conversations(
    chosen: list, rejected: list, chosen_field: str, rejected_field: str
) -> tuple[list[dict[str, str]], Any, Any]:
    """Whole conversations that share everything but their last message: (the shared start, the two last)."""
    first, second = _messages(chosen, chosen_field), _messages(rejected, rejected_field)
    if len(first) < 2 or first[:-1] != second[:-1]:
        raise RowError(
            f"fields '{chosen_field}' and '{rejected_field}' hold conversations that must differ only in their last "
            "message (the reply): give the shared start as data.prompt_field instead"
        )
    return first[:-1], first[-1], second[-1]
