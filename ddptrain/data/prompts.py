"""Prompts the model completes at evaluation (``trainer.eval_prompts``), rendered as the run renders its rows: the
tokens a prompt becomes are the tokens training puts before a response.

A prompt is a text or a row. A text is the instruction (``data.template=alpaca``), the user's message (``chat``,
``sharegpt``) or the text to continue (``text``). A row is what ``data.path`` holds: ``{"instruction", "input"}``,
``{"messages": [...]}`` (a trailing assistant reply is left out: it is what the model is to write), or
``{"prompt": text}`` for a text. The trainer passes the key's value in; a mixture renders with ``data.template``.
No torch in this module.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddptrain.config import DataConfig, Template
from ddptrain.data.encode import RowEncoder, reply_end_tokens
from ddptrain.data.templates import SHAREGPT_ROLES, RowError, alpaca_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Prompt = str | Mapping[str, Any]


def read_prompts(prompts: str | Sequence[Prompt]) -> list[Prompt]:
    """``trainer.eval_prompts``: the list itself, or the prompts of a .txt file (one a non-empty line) or .jsonl file
    (one row a line).

    Raises:
        ValueError: a .jsonl line that is not a JSON object or text, naming the file and line.
    """
    if not isinstance(prompts, str):
        return list(prompts)
    path = Path(prompts).expanduser()
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    if path.suffix == ".txt":
        return [line for _, line in lines]
    rows: list[Prompt] = []
    for n, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"trainer.eval_prompts={prompts}, line {n}: not JSON ({err.msg}).") from None
        if not isinstance(row, (str, dict)):
            raise ValueError(f"trainer.eval_prompts={prompts}, line {n}: a prompt is a text or a row, not {row!r}.")
        rows.append(row)
    return rows


class PromptRenderer:
    """Renders prompts in the run's template and tokenizes them as training does (no special tokens added)."""

    def __init__(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase):
        # Preference pairs' message prompts render as conversations do (the model's template, ChatML without one).
        chat = replace(cfg, template=Template.chat) if cfg.template == Template.preference else cfg
        self.encoder = RowEncoder(chat, tokenizer)
        self.cfg = cfg
        self.tokenizer = tokenizer

    def text(self, prompt: Prompt) -> str:
        """The prompt as the model sees it, up to where its response starts.

        Raises:
            ValueError: a row without what the template needs, naming the key.
        """
        try:
            return self._render(prompt)
        except RowError as err:
            raise ValueError(f"trainer.eval_prompts: the prompt {prompt!r}: {err}.") from None

    def ids(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, as training tokenizes the text before a response.

        Raises:
            ValueError: the prompt renders to no token (nothing to continue).
        """
        ids = self.tokenizer(self.text(prompt), add_special_tokens=False).input_ids
        if not ids:
            raise ValueError(f"trainer.eval_prompts: the prompt {prompt!r} renders to no token: give it some text.")
        return ids

    def stop_ids(self) -> list[int]:
        """Where a completion ends: the EOS, and for conversations the tokens that end a reply in the run's template
        (``encode.reply_end_tokens``): a chat model ends its turn with them, not always with the EOS."""
        stops = {self.tokenizer.eos_token_id}
        if self.cfg.template in (Template.chat, Template.sharegpt, Template.preference):
            stops |= set(reply_end_tokens(self.encoder))
        return sorted(stops)

    def _render(self, prompt: Prompt) -> str:
        c = self.cfg
        if isinstance(prompt, Mapping) and "prompt" in prompt:
            prompt = str(prompt["prompt"])
        if c.template == Template.text:
            return prompt if isinstance(prompt, str) else _field(prompt, c.text_field)
        if c.template == Template.preference and isinstance(prompt, str):  # a plain pair's prompt, as trained on
            return prompt
        if c.template == Template.alpaca:
            if isinstance(prompt, str):
                return alpaca_prompt(prompt, "")
            return alpaca_prompt(_field(prompt, c.instruction_field), str(prompt.get(c.input_field) or ""))
        return self._chat(self._messages(prompt))

    def _messages(self, prompt: Prompt) -> list[dict[str, str]]:
        c = self.cfg
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        if c.template == Template.sharegpt:
            turns = prompt.get(c.conversations_field) or []
            messages = [
                {"role": SHAREGPT_ROLES.get(str(t.get(c.role_field)), "user"), "content": str(t.get(c.content_field))}
                for t in turns
            ]
        else:
            messages = [
                {"role": str(m.get("role")), "content": str(m.get("content"))}
                for m in prompt.get(c.messages_field) or []
            ]
        while messages and messages[-1]["role"] == "assistant":  # what the model is to write
            messages.pop()
        if not messages:
            raise RowError(f"no message before the reply to write (field '{c.messages_field}')")
        return messages

    def _chat(self, messages: list[dict[str, str]]) -> str:
        if self.encoder.chat_template is not None:
            return self.encoder.render(messages, True)
        chatml = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return chatml + "<|im_start|>assistant\n"


def _field(row: Mapping[str, Any], name: str) -> str:
    value = row.get(name)
    if not isinstance(value, str) or not value:
        raise RowError(f"missing text field '{name}'")
    return value
