"""Encoding: a row becomes ``input_ids`` and ``labels``, with what is not trained on labelled ``IGNORE_INDEX``.

The templates (``templates.py``) say what a row's text is and which of it is trained on; ``RowEncoder``
tokenizes a batch of rows at once and labels the tokens, and ``resolve_chat_template`` picks the template
that renders conversations. The data side owns the ignore label: the collator and the loss (``model.py``)
import it from here. No torch and no datasets in this module.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ddptrain.config import DataConfig, Template, is_jinja
from ddptrain.data.sources import locate_row, source_group
from ddptrain.data.templates import (
    Render,
    RowError,
    chat_messages,
    chatml_turns,
    format_alpaca,
    format_text,
    render_chat,
    sharegpt_messages,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__package__)  # "ddptrain.data": the data side's modules log under one name, as before the split

IGNORE_INDEX = -100
"""The label of a token that is not a target (prompt, padding, a packed sample's first token): the value
``torch.nn.functional.cross_entropy`` skips by default."""

# A record every rank logs identically (data statistics): the console prints it on rank 0 alone. The
# attribute is the console's (``observe.console.SAME_ON_ALL_RANKS``), spelled out here so that the data
# side imports no logging code.
RANK_ZERO_ONLY = {"same_on_all_ranks": True}


class RowEncoder:
    """Turns raw rows into input_ids / labels, masking out of the loss what is not trained on.

    Alpaca rows, and chat rows for a tokenizer without a chat template (ChatML), are (prompt,
    response) pieces, tokenized piece by piece with EOS appended. Chat rows under the model's own
    chat template, and plain text, are tokenized as one text exactly as the template writes it; the
    tokens that overlap a span to train on (an assistant reply with its end-of-turn token, or the
    whole text) are labelled.
    """

    def __init__(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.chat_template = resolve_chat_template(cfg, tokenizer)
        self.whole_text = cfg.template == Template.text or self.chat_template is not None
        self._direct: Render | Literal[False] | None = None  # see ``render``; None: not chosen yet
        if self.whole_text and not tokenizer.is_fast:
            # The trained spans are found through the fast tokenizers' character offsets.
            raise ValueError(
                f"data.template={cfg.template.value} needs a fast tokenizer (character offsets), but "
                f"{type(tokenizer).__name__} is not one: point model.tokenizer at a folder with a tokenizer.json, "
                "or for chat rows set data.chat_template=chatml."
            )

    def turns(self, row: dict[str, Any]) -> Any:
        """Pieces (alpaca, ChatML) or ``(text, spans to train on, indices of the spans an EOS is inserted after)``.

        Raises:
            RowError: the row lacks what the template needs.
        """
        c = self.cfg
        if c.template == Template.alpaca:
            return [format_alpaca(row, c.instruction_field, c.input_field, c.output_field)]
        if c.template == Template.text:
            text = format_text(row, c.text_field)
            return text, [(0, len(text))], (0,)
        if c.template == Template.chat:
            messages, field = chat_messages(row, c.messages_field), c.messages_field
        else:
            messages = sharegpt_messages(row, c.conversations_field, c.role_field, c.content_field)
            field = c.conversations_field
        if self.chat_template is None:
            return chatml_turns(messages, field)
        return render_chat(messages, self.render, self.token_ends)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """The chat template applied to checked messages, as ``apply_chat_template(tokenize=False)`` writes them.

        Rendering is most of the chat-template path's time, and ``apply_chat_template`` spends two thirds of each
        call converting messages that are already plain {role, content} strings. So the template's compiled form
        (transformers' own, cached) renders them directly, with the same variables (the tokenizer's special
        tokens), once it has rendered a probe conversation as ``apply_chat_template`` does; where it does not
        (or this transformers has no such function), every render goes through ``apply_chat_template``.
        """
        if self._direct is None:
            self._direct = _direct_renderer(self.tokenizer, self.chat_template, self.apply_chat_template) or False
        return (self._direct or self.apply_chat_template)(messages, add_generation_prompt)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def __getstate__(self) -> dict[str, Any]:
        # datasets' map workers (data.num_proc) receive the encoder pickled: a compiled template is rebuilt there.
        return {**self.__dict__, "_direct": None}

    def token_ends(self, text: str) -> list[int]:
        return [
            end for _, end in self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True).offset_mapping
        ]

    def encode(self, parsed: list[Any]) -> list[tuple[list[int], list[int], bool]]:
        """(input_ids, labels, truncated) per parsed row."""
        if not parsed:  # every row of this batch was malformed and skipped
            return []
        return self.encode_texts(parsed) if self.whole_text else self.encode_turns(parsed)

    def encode_turns(self, turns_per_row: list[list[tuple[str, str]]]) -> list[tuple[list[int], list[int], bool]]:
        """Pieces tokenized one by one, prompts masked; EOS appended after the last response."""
        flat = [turn for turns in turns_per_row for turn in turns]
        # One tokenizer call per batch for prompts and one for responses: ~10x faster than per row.
        prompts = self.tokenizer([p for p, _ in flat], add_special_tokens=False).input_ids
        responses = self.tokenizer([r for _, r in flat], add_special_tokens=False).input_ids
        encoded = []
        k = 0
        for turns in turns_per_row:
            input_ids: list[int] = []
            labels: list[int] = []
            for prompt_ids, response_ids in zip(prompts[k : k + len(turns)], responses[k : k + len(turns)]):
                input_ids += prompt_ids + response_ids
                labels += [IGNORE_INDEX] * len(prompt_ids) + response_ids
            k += len(turns)
            encoded.append(self._truncate([*input_ids, self.eos_id], [*labels, self.eos_id]))
        return encoded

    def encode_texts(
        self, items: list[tuple[str, list[tuple[int, int]], tuple[int, ...]]]
    ) -> list[tuple[list[int], list[int], bool]]:
        """Whole texts tokenized at once; a token is a target when its characters overlap a span. An EOS (a target)
        follows the last token of each span listed as the third item (plain text: the whole text's one span)."""
        tokenized = self.tokenizer(
            [text for text, _, _ in items], add_special_tokens=False, return_offsets_mapping=True
        )
        encoded = []
        for (_, spans, eos_after), ids, offsets in zip(items, tokenized.input_ids, tokenized.offset_mapping):
            ids = list(ids)
            labels = _span_targets(ids, offsets, spans)
            for at in sorted((_after_span(offsets, spans[k]) for k in eos_after), reverse=True):
                ids.insert(at, self.eos_id)
                labels.insert(at, self.eos_id)
            encoded.append(self._truncate(ids, labels))
        return encoded

    def _truncate(self, input_ids: list[int], labels: list[int]) -> tuple[list[int], list[int], bool]:
        limit = self.cfg.max_length
        return input_ids[:limit], labels[:limit], len(input_ids) > limit

    def __call__(
        self, batch: dict[str, list], indices: list[int], source: str, key: str = "data.path"
    ) -> dict[str, list]:
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        turns_per_row: list[Any] = []
        for index, row in zip(indices, rows):
            try:
                turns_per_row.append(self.turns(row))
            except RowError as err:
                skip_or_refuse(err, self.cfg.skip_bad_rows, source, index, key)
                turns_per_row.append(None)
        encoded = iter(self.encode([t for t in turns_per_row if t is not None]))
        out: dict[str, list] = {k: [] for k in ("input_ids", "labels", "length", "truncated", "bad", "no_target")}
        for turns in turns_per_row:
            input_ids, labels, truncated = next(encoded) if turns is not None else ([], [], False)
            out["input_ids"].append(input_ids)
            out["labels"].append(labels)
            out["length"].append(len(input_ids))
            out["truncated"].append(truncated)
            out["bad"].append(turns is None)
            out["no_target"].append(turns is not None and _no_target(labels))
        return out


def skip_or_refuse(err: RowError, skip: bool, source: str, index: int, key: str) -> None:
    """A malformed row: skipped (data.skip_bad_rows=true, counted by the caller), else an error naming its file and
    line, and the fix.

    Raises:
        ValueError: unless ``skip``.
    """
    if not skip:
        raise ValueError(
            f"{locate_row(source, index)}: {err}. Fix the row, set the {source_group(key)}.*_field keys to "
            "your field names, or set data.skip_bad_rows=true to skip such rows."
        ) from None


def _direct_renderer(tokenizer: PreTrainedTokenizerBase, chat_template: str, reference: Render) -> Render | None:
    """The compiled chat template as a ``Render`` (see ``RowEncoder.render``), or None where it would not write what
    ``reference`` (``apply_chat_template``) writes for the probe conversation, with and without the generation
    prompt."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        compiled = _compile_jinja_template(chat_template)
    except Exception:  # another transformers, or a template it compiles otherwise: apply_chat_template renders
        return None
    variables = dict(tokenizer.special_tokens_map)

    def render(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return compiled.render(
            messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **variables
        )

    try:
        same = all(render(PROBE, prompt) == reference(PROBE, prompt) for prompt in (False, True))
    except Exception:  # a template that refuses the probe: let apply_chat_template render (and refuse) every row
        return None
    return render if same else None


def _span_targets(ids: list[int], offsets: Sequence[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """``ids`` with every token that overlaps no span labelled ``IGNORE_INDEX``.

    A fast tokenizer's offsets run in order (starts and ends both non-decreasing), so the tokens that overlap a
    span (end after its start, start before its end) are one run, found by bisection: per row this costs a
    few slices, not a test of every token against every span (a third of the chat-template path's time).
    """
    labels = [IGNORE_INDEX] * len(ids)
    starts, ends = [start for start, _ in offsets], [end for _, end in offsets]
    for span_start, span_end in spans:
        first, stop = bisect.bisect_right(ends, span_start), bisect.bisect_left(starts, span_end)
        labels[first:stop] = ids[first:stop]
    return labels


def _after_span(offsets: Sequence[tuple[int, int]], span: tuple[int, int]) -> int:
    """The token position just after ``span``: past every token that starts before the span's end."""
    return bisect.bisect_left([start for start, _ in offsets], span[1])


def resolve_chat_template(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The Jinja chat template that renders chat rows, or None for ChatML pieces (``format_chat``).

    ``data.chat_template``: null = the tokenizer's own (None when it has none), ``chatml``, a path to
    a template file, or the template itself.
    """
    if cfg.template not in (Template.chat, Template.sharegpt) or cfg.chat_template == "chatml":
        return None
    if cfg.chat_template is None:
        own = tokenizer.chat_template
        return own.get("default") if isinstance(own, dict) else own
    if is_jinja(cfg.chat_template):
        return cfg.chat_template
    return Path(cfg.chat_template).expanduser().read_text()  # the config check found the file


def log_chat_format(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """Say (once, on rank 0) how conversations are rendered, warn when ChatML stands in for a missing template, and
    check that the template's replies end in a way the model can learn to stop (``check_reply_endings``)."""
    if cfg.template not in (Template.chat, Template.sharegpt):
        return
    chat_template = resolve_chat_template(cfg, tokenizer)
    if chat_template is not None:
        where = "data.chat_template" if cfg.chat_template else "the tokenizer's own chat template"
        log.info("data: conversations rendered with %s", where, extra=RANK_ZERO_ONLY)
        check_reply_endings(RowEncoder(cfg, tokenizer), where)
    elif cfg.chat_template != "chatml":
        log.warning(
            "data: model.tokenizer has no chat template, so conversations use ChatML (Qwen's format). For "
            "another model family set data.chat_template to its template (a Jinja string or a file).",
            extra=RANK_ZERO_ONLY,
        )


# Two replies: the first is followed by another turn, the second ends the conversation; templates often end the
# two differently (Phi-3 writes the EOS only at the very end).
PROBE = [
    {"role": "user", "content": "Hello."},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "Thanks."},
    {"role": "assistant", "content": "Bye."},
]


def check_reply_endings(encoder: RowEncoder, where: str) -> None:
    """Render a probe conversation as training will: say when ddptrain appends the EOS to each reply (the template
    writes nothing after one), and warn when a reply's trained tokens end in a token that is not special (an
    end-of-turn marker, an added token or the EOS): a model trained on them never learns to end its turn."""
    try:
        text, spans, eos_after = render_chat(PROBE, encoder.render, encoder.token_ends)
    except RowError as err:
        log.debug("data: the reply-ending check could not render its probe conversation: %s", err)
        return
    if eos_after:
        log.info(
            "data: %s writes nothing after a reply: ddptrain inserts the EOS (%s) after each such reply and trains it",
            where,
            encoder.tokenizer.eos_token,
            extra=RANK_ZERO_ONLY,
        )
    ((ids, labels, _),) = encoder.encode_texts([(text, spans, eos_after)])
    # Special and added tokens: control tokens the model emits whole (Qwen's <|im_end|>, Llama's <|eot_id|>).
    special = set(encoder.tokenizer.all_special_ids) | set(encoder.tokenizer.added_tokens_decoder)
    for last in _last_targets(ids, labels):
        if last not in special:
            log.warning(
                "data: with %s a reply's trained tokens end in %r, which is no end-of-turn token, so the model will "
                "not learn to stop. Set data.chat_template to a template that writes the model's end-of-turn token "
                "after each reply (or data.chat_template=chatml).",
                where,
                encoder.tokenizer.decode([last]),
                extra=RANK_ZERO_ONLY,
            )
            return


def reply_end_tokens(encoder: RowEncoder) -> list[int]:
    """The special or added tokens that end a reply when training renders the probe conversation (Qwen's
    ``<|im_end|>``, Llama 3's ``<|eot_id|>``, the EOS ddptrain appends): where a completion of a conversation stops.
    Empty when the template refuses the probe."""
    try:
        if encoder.chat_template is None:
            ((ids, labels, _),) = encoder.encode_turns([chatml_turns(PROBE)])
        else:
            ((ids, labels, _),) = encoder.encode_texts([render_chat(PROBE, encoder.render, encoder.token_ends)])
    except RowError:
        return []
    special = set(encoder.tokenizer.all_special_ids) | set(encoder.tokenizer.added_tokens_decoder)
    return sorted({token for token in _last_targets(ids, labels) if token in special})


def _last_targets(ids: Sequence[int], labels: Sequence[int]) -> list[int]:
    """The last token of each unbroken run of targets."""
    return [
        token
        for k, (token, label) in enumerate(zip(ids, labels))
        if label != IGNORE_INDEX and (k + 1 == len(labels) or labels[k + 1] == IGNORE_INDEX)
    ]


def _no_target(labels: Sequence[int]) -> bool:
    # Position 0 is never predicted, so a row needs a target after it.
    return all(label == IGNORE_INDEX for label in labels[1:])
