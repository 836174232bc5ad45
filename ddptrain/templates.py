"""Prompt templates: turn one raw row into (prompt text, response text).

Only the response (and the EOS appended after it) is trained on; the prompt is
masked out of the loss. Kept free of torch so that benchmarks and tests can use it
on their own.
"""

from __future__ import annotations

from collections.abc import Mapping
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
    """Split a chat row into (prompt, response) turns, one per assistant message.

    The prompt of each turn is every message since the previous assistant reply, in
    ChatML (the Qwen2 chat format); the response is the assistant's content plus
    ``<|im_end|>``. Concatenating all turns gives the whole conversation.

    Raises:
        RowError: the field is missing, is not a list of {role, content}, or has no assistant turn.
    """
    messages = row.get(messages_field)
    if not isinstance(messages, list) or not messages:
        raise RowError(f"field '{messages_field}' must be a non-empty list of {{role, content}} messages")
    turns: list[tuple[str, str]] = []
    prompt = ""
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not {"role", "content"} <= message.keys():
            raise RowError(f"message {i} of '{messages_field}' needs 'role' and 'content'")
        role, content = str(message["role"]), str(message["content"])
        if role == "assistant":
            turns.append((prompt + "<|im_start|>assistant\n", content + "<|im_end|>"))
            prompt = "\n"
        else:
            prompt += f"<|im_start|>{role}\n{content}<|im_end|>\n"
    if not turns:
        raise RowError(f"'{messages_field}' has no message with role 'assistant' to train on")
    return turns


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
