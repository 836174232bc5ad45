"""Prompt templates: turn one raw row into what is trained on.

Alpaca rows become (prompt text, response text): only the response (and the EOS appended after
it) is trained on. Chat rows (OpenAI ``messages`` or ShareGPT ``conversations``) become checked
{role, content} messages, rendered by the model's own chat template (``render_chat``: the whole
conversation, and the spans of the assistant replies to train on) or, for a tokenizer without
one, by ChatML (``format_chat``). Kept free of torch so that benchmarks and tests can use it on
their own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


class RowError(ValueError):
    """A row that does not have the fields the template needs."""


def alpaca_prompt(instruction: str, input_text: str) -> str:
    """The standard Alpaca prompt, with or without the input section."""
    if input_text:
        return ALPACA_PROMPT.format(instruction=instruction, input=input_text)
    return ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)


def format_alpaca(
    row: Mapping[str, Any],
    instruction_field: str = "instruction",
    input_field: str = "input",
    output_field: str = "output",
) -> tuple[str, str]:
    """Split an Alpaca-style row into (prompt, response).

    Raises:
        RowError: a required field is missing or is not a string.
    """
    instruction = _text_field(row, instruction_field, required=True)
    output = _text_field(row, output_field, required=True)
    input_text = _text_field(row, input_field, required=False)
    return alpaca_prompt(instruction, input_text), output


def format_chat(row: Mapping[str, Any], messages_field: str = "messages") -> list[tuple[str, str]]:
    """Split a chat row into (prompt, response) turns in ChatML, one per assistant message.

    ChatML is the Qwen2 chat format, used when the tokenizer has no chat template of its own (or with
    ``data.chat_template=chatml``). The prompt of each turn is every message since the previous
    assistant reply; the response is the assistant's content plus ``<|im_end|>``. Concatenating all
    turns gives the whole conversation.

    Raises:
        RowError: the field is missing, is not a list of {role, content}, or has no assistant turn.
    """
    return chatml_turns(chat_messages(row, messages_field), messages_field)


def chatml_turns(messages: list[dict[str, str]], field: str = "messages") -> list[tuple[str, str]]:
    """ChatML (prompt, response) turns of checked messages (see ``format_chat``)."""
    turns: list[tuple[str, str]] = []
    prompt = ""
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "assistant":
            turns.append((prompt + "<|im_start|>assistant\n", content + "<|im_end|>"))
            prompt = "\n"
        else:
            prompt += f"<|im_start|>{role}\n{content}<|im_end|>\n"
    return turns


def chat_messages(row: Mapping[str, Any], messages_field: str = "messages") -> list[dict[str, str]]:
    """The {role, content} messages of an OpenAI-style chat row, checked.

    Raises:
        RowError: the field is missing, is not a list of {role, content}, or has no assistant turn.
    """
    messages = row.get(messages_field)
    if not isinstance(messages, list) or not messages:
        raise RowError(f"field '{messages_field}' must be a non-empty list of {{role, content}} messages")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not {"role", "content"} <= message.keys():
            raise RowError(f"message {i} of '{messages_field}' needs 'role' and 'content'")
        checked.append({"role": str(message["role"]), "content": str(message["content"])})
    return _with_an_assistant_turn(checked, messages_field)


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def sharegpt_messages(
    row: Mapping[str, Any], field: str = "conversations", role_field: str = "from", content_field: str = "value"
) -> list[dict[str, str]]:
    """A ShareGPT row (``{"conversations": [{"from": "human", "value": ...}, ...]}``) as {role, content} messages.

    Raises:
        RowError: the field is missing or malformed, a speaker is unknown, or no turn is by ``gpt``.
    """
    turns = row.get(field)
    if not isinstance(turns, list) or not turns:
        raise RowError(f"field '{field}' must be a non-empty list of {{{role_field}, {content_field}}} turns")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, Mapping) or not {role_field, content_field} <= turn.keys():
            raise RowError(f"turn {i} of '{field}' needs '{role_field}' and '{content_field}'")
        role = SHAREGPT_ROLES.get(str(turn[role_field]))
        if role is None:
            known = ", ".join(SHAREGPT_ROLES)
            raise RowError(f"turn {i} of '{field}' is by '{turn[role_field]}': expected one of {known}")
        messages.append({"role": role, "content": str(turn[content_field])})
    return _with_an_assistant_turn(messages, field)


def _with_an_assistant_turn(messages: list[dict[str, str]], field: str) -> list[dict[str, str]]:
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError(f"'{field}' has no assistant turn to train on")
    return messages


Render = Callable[[list[dict[str, str]], bool], str]
"""``render(messages, add_generation_prompt)``: a chat template applied to messages, as text."""
TokenEnds = Callable[[str], list[int]]
"""``token_ends(text)``: where each token of ``text`` ends, in characters (the tokenizer's offsets)."""


def render_chat(
    messages: list[dict[str, str]], render: Render, token_ends: TokenEnds
) -> tuple[str, list[tuple[int, int]], tuple[int, ...]]:
    """The whole conversation as the chat template writes it, the character spans to train on, and which of those
    spans are followed by an EOS that the template does not write (their indices).

    A reply's span is the reply and whatever the template writes after it before the next turn starts: the text
    after the reply in the conversation rendered through that reply, as far as the whole conversation agrees with
    it, trailing whitespace excluded, and cut back to a whole token where the two part in the middle of one
    (``token_ends``: Phi-3's ``<|endoftext|>`` and ``<|user|>`` share their first characters). So a reply's
    end-of-turn marker is trained also where the template writes the EOS only at the very end of a conversation
    (Phi-3: ``<|end|>`` after every reply, the EOS once) or trims the message text (Gemma). Where it writes nothing
    after a reply, the span's index is returned: the encoder inserts an EOS there, so that the model still learns
    to stop. An empty reply is not trained on.

    The span starts where the template's generation prompt ends (the conversation so far rendered with
    ``add_generation_prompt``), when that rendering is where the whole conversation begins. Some templates rewrite
    earlier turns as the conversation grows (Mistral v0.3 puts the system message before the last user message);
    there, and for a reply that opens the conversation, the span starts where the reply's text does, found in order
    after the messages before it (nothing before a reply is trained on, not even a default system prompt).

    Raises:
        RowError: the template rejects the conversation (e.g. roles that do not alternate), or a reply's text
            cannot be found in the rendering.
    """
    try:
        full = render(messages, False)
        spans, eos_after = _reply_spans(messages, render, full, token_ends)
    except RowError:
        raise
    except Exception as err:  # jinja's TemplateError, or raise_exception() inside the template
        raise RowError(f"the chat template refused this conversation: {err}") from None
    return full, spans, eos_after


def _reply_spans(
    messages: list[dict[str, str]], render: Render, full: str, token_ends: TokenEnds
) -> tuple[list[tuple[int, int]], tuple[int, ...]]:
    spans: list[tuple[int, int]] = []
    eos_after: list[int] = []
    position = 0  # where the previous message's text (and a reply's end-of-turn) ended in ``full``
    for i, message in enumerate(messages):
        if message["role"] == "system":  # some templates move it; user and assistant turns keep their order
            continue
        prompt_end = _generation_prompt_end(messages, i, render, full, position)
        text = message["content"].strip()
        found = full.find(text, position if prompt_end is None else prompt_end)
        if found < 0 and message["role"] != "assistant":  # a template may rewrite what the user wrote
            continue
        if found < 0:
            raise RowError(
                f"message {i} (assistant) is not in the chat template's rendering of the conversation, so "
                "its place cannot be found: set data.chat_template to a template that writes every message "
                "(or data.chat_template=chatml)"
            )
        position = found + len(text)
        if message["role"] != "assistant" or not text:  # an empty reply: nothing to learn, nothing to end
            continue
        through = full if i == len(messages) - 1 else render(messages[: i + 1], False)  # a render less per row
        # Where the reply ends in ``through``: as in ``full`` while the two agree that far, else found in order.
        reply_end = position if through.startswith(full[:position]) else _reply_end(through, messages, i, render)
        written_after = through[reply_end:]
        end_of_turn = _agreed_tokens(written_after, full[position:], token_ends).rstrip()
        position += len(end_of_turn)
        spans.append((found if prompt_end is None else prompt_end, position))
        if not end_of_turn.strip():
            eos_after.append(len(spans) - 1)
    return spans, tuple(eos_after)


def _reply_end(through: str, messages: list[dict[str, str]], i: int, render: Render) -> int:
    """Where reply ``i``'s text ends in ``through`` (the conversation rendered up to that reply, by a template that
    writes it otherwise than the whole conversation does: Qwen3 opens the last reply with a think block, Mistral v0.3
    moves the system message): where the reply stands when its text is marked, else each message's text found in
    order from the start."""
    text = messages[i]["content"].strip()
    start = _marked_reply_start(through, messages[: i + 1], i, render, -1)
    if start >= 0:
        return start + len(text)
    position = 0
    for message in messages[: i + 1]:
        if message["role"] != "system":
            found = through.find(message["content"].strip(), position)
            if found < 0:  # rewritten beyond finding: nothing known after the reply
                return len(through)
            position = found + len(message["content"].strip())
    return position


_MARK = "\x00reply\x00"


def _marked_reply_start(rendered: str, messages: list[dict[str, str]], i: int, render: Render, otherwise: int) -> int:
    """Where reply ``i``'s text starts in ``rendered`` (the template applied to ``messages``): the conversation is
    rendered once more with the reply's text replaced by a mark, and the mark's place is the reply's where the two
    renderings agree up to it. A plain search can stop inside text the template writes around the reply: "hi" in
    Qwen3's ``<think>``, "d" in a previous ``<|im_end|>``. ``otherwise`` where the mark does not settle it."""
    text = messages[i]["content"].strip()
    marked = render([*messages[:i], {**messages[i], "content": _MARK}, *messages[i + 1 :]], False)
    at = marked.find(_MARK)
    if at >= 0 and rendered.startswith(marked[:at]) and rendered.startswith(text, at):
        return at
    return otherwise


def _generation_prompt_end(
    messages: list[dict[str, str]], i: int, render: Render, full: str, position: int
) -> int | None:
    """Where reply ``i``'s span starts: the end of the generation prompt after the turns before it, when the whole
    conversation begins with that rendering; None otherwise (the span then starts at the reply's text)."""
    if messages[i]["role"] != "assistant" or i == 0:
        return None
    before = render(messages[:i], True)
    return len(before) if len(before) >= position and full.startswith(before) else None


def _agreed_tokens(written: str, full: str, token_ends: TokenEnds) -> str:
    """The longest prefix of ``written`` that ``full`` starts with too, ending where a token of ``written`` ends."""
    n = 0
    for x, y in zip(written, full):
        if x != y:
            break
        n += 1
    if n == len(written):
        return written
    return written[: max((end for end in token_ends(written) if end <= n), default=0)]


def format_text(row: Mapping[str, Any], text_field: str = "text") -> str:
    """The text of a plain-text row (``data.template=text``: every token is trained on).

    Raises:
        RowError: the field is missing or is not a string.
    """
    return _text_field(row, text_field, required=True)


def _text_field(row: Mapping[str, Any], name: str, required: bool) -> str:
    value = row.get(name)
    if value is None:
        if required:
            present = sorted(key for key, v in row.items() if v is not None)
            raise RowError(f"missing field '{name}' (present: {', '.join(present) or 'none'})")
        return ""
    if not isinstance(value, str):
        raise RowError(f"field '{name}' must be text, got {type(value).__name__}")
    return value
