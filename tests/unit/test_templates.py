"""Prompt templates: which text is the prompt (masked) and which is the response (trained on)."""

from __future__ import annotations

import pytest

from ddptrain.data.templates import RowError, alpaca_prompt, format_alpaca, format_chat


def test_alpaca_with_input_puts_instruction_and_input_in_the_prompt():
    prompt, response = format_alpaca({"instruction": "Add the numbers.", "input": "2 + 3", "output": "5"})
    assert response == "5"
    assert "### Instruction:\nAdd the numbers.\n\n### Input:\n2 + 3\n\n### Response:\n" in prompt
    assert prompt.endswith("### Response:\n")
    assert "5" not in prompt.replace("2 + 3", "")


def test_alpaca_without_input_uses_the_no_input_prompt():
    for row in (
        {"instruction": "Say hi.", "output": "hi"},
        {"instruction": "Say hi.", "input": "", "output": "hi"},
        {"instruction": "Say hi.", "input": None, "output": "hi"},
    ):
        prompt, response = format_alpaca(row)
        assert response == "hi"
        assert "### Input:" not in prompt
        assert "paired with an input" not in prompt
        assert prompt.endswith("### Instruction:\nSay hi.\n\n### Response:\n")
        assert prompt == alpaca_prompt("Say hi.", "")


@pytest.mark.parametrize("missing", ["instruction", "output"])
def test_alpaca_missing_required_field_is_a_row_error_naming_it(missing):
    row = {"instruction": "Say hi.", "input": "", "output": "hi"}
    del row[missing]
    with pytest.raises(RowError, match=f"'{missing}'"):
        format_alpaca(row)


def test_alpaca_non_text_field_is_a_row_error():
    with pytest.raises(RowError, match=r"'output'.*int"):
        format_alpaca({"instruction": "Count.", "output": 3})


def test_alpaca_field_names_are_configurable():
    row = {"q": "What is 2 + 2?", "ctx": "arithmetic", "a": "4"}
    prompt, response = format_alpaca(row, instruction_field="q", input_field="ctx", output_field="a")
    assert response == "4"
    assert prompt == alpaca_prompt("What is 2 + 2?", "arithmetic")
    with pytest.raises(RowError, match="'instruction'"):
        format_alpaca(row)


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


def test_chat_only_assistant_content_is_the_response():
    turns = format_chat({"messages": CONVERSATION})
    assert [response for _, response in turns] == ["Hello!<|im_end|>", "4<|im_end|>"]
    for prompt, _ in turns:
        assert prompt.endswith("<|im_start|>assistant\n")
    assert "Be brief." in turns[0][0] and "Hi" in turns[0][0]
    assert "2+2?" in turns[1][0]
    # Neither the system nor the user text is ever part of a response.
    for _, response in turns:
        assert "Be brief." not in response and "Hi" not in response and "2+2?" not in response


def test_chat_turns_concatenate_to_the_whole_conversation_in_chatml():
    turns = format_chat({"messages": CONVERSATION})
    whole = "".join(prompt + response for prompt, response in turns)
    expected = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CONVERSATION)
    assert whole == expected.removesuffix("\n")


def test_chat_messages_field_is_configurable():
    turns = format_chat({"conv": CONVERSATION[1:3]}, messages_field="conv")
    assert turns == [("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "Hello!<|im_end|>")]


@pytest.mark.parametrize(
    "row",
    [
        {"messages": [{"role": "user", "content": "Hi"}]},
        {"messages": []},
        {"other": CONVERSATION},
        {"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]},
    ],
)
def test_chat_rows_without_a_trainable_assistant_turn_are_row_errors(row):
    with pytest.raises(RowError, match="messages"):
        format_chat(row)
