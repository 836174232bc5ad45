"""Conversations in the model's own chat template, ShareGPT rows and plain text (issue 13, parts 3 and 4).

The oracle is the tokenizer itself: ``apply_chat_template(..., tokenize=True)`` gives the ids the
model will be prompted with, and each family's template says how an assistant reply ends. The
training ids must equal the former token for token, and the labelled tokens must read back as
exactly the assistant replies with their end-of-turn token, in order.
"""

from __future__ import annotations

import copy
import json
import logging
import sys
from pathlib import Path

import pytest
from transformers.utils import chat_template_utils

from ddptrain.config import DataConfig, Template
from ddptrain.data import IGNORE_INDEX, RowEncoder, encode, tokenize_file
from ddptrain.data.encode import log_chat_format
from ddptrain.data.templates import RowError
from ddptrain.model import build_tokenizer
from tests.conftest import QWEN2_TOKENIZER, compose_config, requires_shared, skip_or_fail

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Mistral's [INST] format: a system message goes in front of the first user message.
MISTRAL = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set system = none %}{%- set loop_messages = messages %}"
    "{%- endif %}{{ bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
    "{%- if loop.first and system %}{{ '[INST] ' + system + '\n\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{ '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}{%- endif %}{%- endfor %}"
)
# Llama 3.1's shape: a system header (with dates) in every conversation, even without a system message.
LLAMA31 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set system = '' %}{% set loop_messages = messages %}"
    "{% endif %}{{ '<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
    "Today Date: 26 Jul 2024\n\n' + system + '<|eot_id|>' }}{% for message in loop_messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Mistral v0.3's shape: the system message goes in front of the *last* user message, so a growing
# conversation rewrites earlier turns (and a conversation that ends with a reply loses it).
MISTRAL_V3 = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}{{- '[INST] ' + system_message + '\n\n' + message['content']"
    " + '[/INST]' }}{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}{%- endif %}{%- endfor %}"
)

# Phi-3's shape: "<|end|>" after every message, the EOS once at the very end of a conversation without a generation
# prompt. A reply followed by another turn is therefore not a prefix of the whole conversation.
PHI3 = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
# Gemma's shape: no system role, the assistant is "model", every message trimmed.
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' "
    "else message['role'] %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# Zephyr's shape: the EOS then a newline after every message.
ZEPHYR = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
# Qwen3's shape: ChatML, and the reply after the last user turn opens with a <think> block (empty without reasoning),
# so a reply is written one way while it is the last and another once a user turn follows it.
QWEN3 = (
    "{%- set ns = namespace(last_query=-1) %}{%- for m in messages %}{%- if m['role'] == 'user' %}"
    "{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}{{- '<|im_start|>assistant\n' }}{%- if loop.index0 > ns.last_query %}"
    "{{- '<think>\n\n</think>\n\n' }}{%- endif %}{{- m['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
# Nothing after a reply: ddptrain inserts the EOS.
BARE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)

SYSTEM = {"role": "system", "content": "You answer in one line."}
TURNS = [
    {"role": "user", "content": "Name a prime number."},
    {"role": "assistant", "content": "Seven is prime."},
    {"role": "user", "content": "And an even one?"},
    {"role": "assistant", "content": "Two, the only even prime."},
]
OPENER = {"role": "assistant", "content": "Ask me about primes."}
# One-letter replies that also occur inside the templates' end-of-turn markers ("d" in <|end|>, "e" in <end_of_turn>).
LETTERS = [
    {"role": "user", "content": "Which of a, b, c, d is a vowel? One letter."},
    {"role": "assistant", "content": "d"},
    {"role": "user", "content": "Wrong. Again?"},
    {"role": "assistant", "content": "e"},
]
# Replies that also occur inside text the template writes before them (Qwen3's "<think>" holds "hi" and "k").
THINK_LETTERS = [
    {"role": "user", "content": "Say hi."},
    {"role": "assistant", "content": "hi"},
    {"role": "user", "content": "A letter of think?"},
    {"role": "assistant", "content": "k"},
]
CONVERSATIONS = [
    TURNS,
    THINK_LETTERS,
    [SYSTEM, *TURNS],
    [SYSTEM, *TURNS[:2]],
    [OPENER, *TURNS],
    [SYSTEM, OPENER, *TURNS[:2]],
    LETTERS,
]
# Gemma refuses a system message; its template trims what the others write as given.
PADDED = [
    {"role": "user", "content": "  Name a prime number.\n"},
    {"role": "assistant", "content": " Seven is prime. \n"},
]
NO_SYSTEM = [TURNS, [OPENER, *TURNS], PADDED, LETTERS, THINK_LETTERS]


def with_template(template: str, bos: str, eos: str, special: list[str]):
    """The bundled tokenizer made to speak another family's format (its control tokens are single tokens)."""
    tokenizer = copy.deepcopy(build_tokenizer(compose_config([]).model))
    tokenizer.add_special_tokens({"bos_token": bos, "eos_token": eos, "additional_special_tokens": special})
    tokenizer.chat_template = template
    return tokenizer


def family(name: str):
    """(tokenizer, how the template ends an assistant reply)."""
    if name == "qwen2":
        if not QWEN2_TOKENIZER.is_dir():
            skip_or_fail("needs ../shared/data/tokenizers/qwen2")
        return build_tokenizer(compose_config([f"model.tokenizer={QWEN2_TOKENIZER}"]).model), "{}<|im_end|>"
    llama_special = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    if name in ("llama3", "llama3.1"):
        template = LLAMA3 if name == "llama3" else LLAMA31
        return with_template(template, "<|begin_of_text|>", "<|eot_id|>", llama_special), "{}<|eot_id|>"
    roles = ["<|system|>", "<|user|>", "<|assistant|>"]
    if name == "phi3":
        return with_template(PHI3, "<s>", "<|endoftext|>", [*roles, "<|end|>"]), "{}<|end|>"
    if name == "gemma":
        return with_template(GEMMA, "<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>"]), "{}<end_of_turn>"
    if name == "qwen3":
        special = ["<|im_start|>", "<think>", "</think>"]
        return with_template(QWEN3, "<|endoftext|>", "<|im_end|>", special), "{}<|im_end|>"
    if name == "zephyr":
        return with_template(ZEPHYR, "<s>", "</s>", roles), "{}</s>"
    template = MISTRAL if name == "mistral" else MISTRAL_V3
    return with_template(template, "<s>", "</s>", ["[INST]", "[/INST]"]), " {}</s>"


# What a template writes after the conversation's last reply, beyond how it ends every reply (its trained span
# runs to the conversation's end, trailing whitespace excluded).
LAST_REPLY_END = {"phi3": "\n<|endoftext|>"}
# What a template writes before the last reply only: Qwen3's (empty) think block, which the model is to write.
LAST_REPLY_START = {"qwen3": "<think>\n\n</think>\n\n"}


def target_runs(ids: list[int], labels: list[int], tokenizer) -> list[str]:
    """The labelled tokens as text, one string per unbroken run."""
    runs, current = [], []
    for token, label in zip(ids, labels):
        if label != IGNORE_INDEX:
            assert label == token, "a target must be the token at its position"
            current.append(token)
        elif current:
            runs, current = [*runs, current], []
    runs += [current] if current else []
    return [tokenizer.decode(run, skip_special_tokens=False) for run in runs]


def encode_file(tmp_path: Path, cache: Path, tokenizer, rows: list[dict], **settings):
    """Tokenize ``rows`` from ``tmp_path/rows.jsonl``, written once: a second call with the same rows reads the
    same unchanged file, so only the settings can tell the cache apart."""
    path = tmp_path / "rows.jsonl"
    text = "".join(json.dumps(row) + "\n" for row in rows)
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    cfg = DataConfig(path=str(path), cache_dir=str(cache), max_length=4096, **settings)
    return tokenize_file(str(path), cfg, tokenizer, None)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("qwen2", marks=requires_shared),
        *("llama3", "llama3.1", "mistral", "mistral-v0.3", "phi3", "gemma", "zephyr", "qwen3"),
    ],
)
def test_training_ids_are_the_templates_and_only_assistant_replies_are_trained(name, tmp_path, datasets_cache):
    """Each reply's targets are the reply and the template's end-of-turn text after it (Phi-3's ``<|end|>`` too,
    though its EOS comes only at the end of the conversation), however the template writes the message."""
    tokenizer, reply_end = family(name)
    conversations = NO_SYSTEM if name == "gemma" else CONVERSATIONS
    rows = [{"messages": messages} for messages in conversations]
    data, stats = encode_file(tmp_path, datasets_cache, tokenizer, rows, template=Template.chat)
    assert stats["skipped_bad"] == 0 and len(data) == len(conversations)
    for messages, row in zip(conversations, data):
        expected_ids = tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
        assert row["input_ids"] == expected_ids, "training ids differ from the model's own chat format"
        replies = [reply_end.format(m["content"].strip()) for m in messages if m["role"] == "assistant"]
        replies[-1] = LAST_REPLY_START.get(name, "") + replies[-1] + LAST_REPLY_END.get(name, "")
        assert target_runs(row["input_ids"], row["labels"], tokenizer) == replies


def test_a_template_that_writes_nothing_after_a_reply_gets_the_eos_inserted_and_says_so(
    tmp_path, datasets_cache, caplog
):
    tokenizer = with_template(BARE, "<s>", "</s>", [])
    rows = [{"messages": messages} for messages in CONVERSATIONS]
    data, _ = encode_file(tmp_path, datasets_cache, tokenizer, rows, template=Template.chat)
    eos = tokenizer.eos_token_id
    for messages, row in zip(CONVERSATIONS, data):
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        # A reply's last token may hold the newline after it (".\n" is one token here, "d\n" two): trained whole,
        # then the inserted EOS.
        runs = target_runs(row["input_ids"], row["labels"], tokenizer)
        assert [run.replace("\n</s>", "</s>") for run in runs] == [f" {r}</s>" for r in replies]
        without_eos = [token for token in row["input_ids"] if token != eos]
        assert without_eos == tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
        assert row["input_ids"].count(eos) == len(replies), "one EOS per reply, nothing else added"
    with caplog.at_level(logging.INFO, logger="ddptrain.data"):
        log_chat_format(DataConfig(path="unused.jsonl", template=Template.chat), tokenizer)
    assert "writes nothing after a reply: ddptrain inserts the EOS (</s>) after each such reply" in caplog.text
    assert "no end-of-turn token" not in caplog.text


def test_conversations_render_as_apply_chat_template_writes_them_even_where_the_compiled_template_would_not(
    monkeypatch,
):
    """ddptrain renders with the template's compiled form directly (a third of the time); a transformers whose
    compiled form writes something else than apply_chat_template must not change what is trained on."""
    tokenizer, _ = family("zephyr")
    fast = RowEncoder(DataConfig(path="x.jsonl", template=Template.chat), tokenizer)
    fast.turns({"messages": CONVERSATIONS[0]})
    assert callable(fast._direct), "the compiled template renders the shipped families directly (the fast path)"
    real = chat_template_utils._compile_jinja_template

    def compiled_otherwise(template: str):  # for ddptrain's renderer only: apply_chat_template keeps the real one
        return real(
            template + "{{ '[extra]' }}" if sys._getframe(1).f_globals["__name__"] == encode.__name__ else template
        )

    monkeypatch.setattr(chat_template_utils, "_compile_jinja_template", compiled_otherwise)
    encoder = RowEncoder(DataConfig(path="x.jsonl", template=Template.chat), tokenizer)
    for messages in CONVERSATIONS:
        text, _, _ = encoder.turns({"messages": messages})
        assert text == tokenizer.apply_chat_template(messages, tokenize=False)


def test_an_empty_reply_is_not_trained_and_the_replies_around_it_are():
    tokenizer, _ = family("llama3")
    empty = [TURNS[0], {"role": "assistant", "content": "  "}, *TURNS[2:]]
    text, spans, eos_after = RowEncoder(DataConfig(path="x.jsonl", template=Template.chat), tokenizer).turns(
        {"messages": empty}
    )
    assert [text[a:b] for a, b in spans] == ["Two, the only even prime.<|eot_id|>"] and not eos_after


def test_a_reply_that_ends_in_plain_text_is_warned_about_and_a_proper_ending_is_not(caplog):
    plain = BARE.replace("message['content'] + '\n'", "message['content'] + ' [END]\n'")
    assert plain != BARE
    cfg = DataConfig(path="unused.jsonl", template=Template.chat)
    with caplog.at_level(logging.INFO, logger="ddptrain.data"):
        log_chat_format(cfg, with_template(plain, "<s>", "</s>", []))
    assert "with the tokenizer's own chat template a reply's trained tokens end in" in caplog.text
    assert "which is no end-of-turn token, so the model will not learn to stop" in caplog.text
    for name in ("phi3", "gemma", "mistral-v0.3"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ddptrain.data"):
            log_chat_format(cfg, family(name)[0])
        assert "no end-of-turn token" not in caplog.text and "nothing after a reply" not in caplog.text, name


def test_sharegpt_rows_train_like_the_same_conversation_in_messages(tmp_path, datasets_cache):
    tokenizer, _ = family("llama3")
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    messages = CONVERSATIONS[1]
    sharegpt = {"conversations": [{"from": speaker[m["role"]], "value": m["content"]} for m in messages]}
    as_sharegpt, _ = encode_file(tmp_path, datasets_cache, tokenizer, [sharegpt], template=Template.sharegpt)
    (tmp_path / "again").mkdir()
    as_messages, _ = encode_file(
        tmp_path / "again", datasets_cache, tokenizer, [{"messages": messages}], template=Template.chat
    )
    assert as_sharegpt[0]["input_ids"] == as_messages[0]["input_ids"]
    assert as_sharegpt[0]["labels"] == as_messages[0]["labels"]


def test_sharegpt_field_names_are_configurable_and_unknown_speakers_are_named():
    tokenizer, _ = family("llama3")
    cfg = DataConfig(
        path="unused.jsonl", template=Template.sharegpt, conversations_field="c", role_field="who", content_field="t"
    )
    encoder = RowEncoder(cfg, tokenizer)
    text, spans, eos_after = encoder.turns({"c": [{"who": "human", "t": "Hi"}, {"who": "gpt", "t": "Hello"}]})
    assert [text[a:b] for a, b in spans] == ["Hello<|eot_id|>"] and not eos_after
    with pytest.raises(RowError, match=r"turn 1 of 'c' is by 'bot'"):
        encoder.turns({"c": [{"who": "human", "t": "Hi"}, {"who": "bot", "t": "Hello"}]})


def test_a_template_that_refuses_a_conversation_is_a_row_error_that_skip_bad_rows_counts(tmp_path, datasets_cache):
    tokenizer, _ = family("llama3")
    refuses = "{% if messages | length > 2 %}{{ raise_exception('only one exchange') }}{% endif %}" + LLAMA3
    rows = [{"messages": TURNS[:2]}, {"messages": TURNS}]
    with pytest.raises(ValueError, match=r"rows\.jsonl:2: the chat template refused this conversation"):
        encode_file(tmp_path, datasets_cache, tokenizer, rows, template=Template.chat, chat_template=refuses)
    data, stats = encode_file(
        tmp_path, datasets_cache, tokenizer, rows, template=Template.chat, chat_template=refuses, skip_bad_rows=True
    )
    assert stats["skipped_bad"] == 1 and len(data) == 1


def test_data_chat_template_overrides_the_tokenizers_from_a_file_or_as_chatml(tmp_path, datasets_cache):
    tokenizer, _ = family("llama3")
    (tmp_path / "mistral.jinja").write_text(MISTRAL.replace("eos_token", "'<|eot_id|>'"))
    from_file = DataConfig(path="unused.jsonl", template=Template.chat, chat_template=str(tmp_path / "mistral.jinja"))
    text, spans, _ = RowEncoder(from_file, tokenizer).turns({"messages": TURNS[:2]})
    assert text.startswith("<|begin_of_text|>[INST] Name a prime number.[/INST]")
    assert [text[a:b] for a, b in spans] == [" Seven is prime.<|eot_id|>"]
    chatml = DataConfig(path="unused.jsonl", template=Template.chat, chat_template="chatml")
    assert RowEncoder(chatml, tokenizer).turns({"messages": TURNS[:2]}) == [
        ("<|im_start|>user\nName a prime number.<|im_end|>\n<|im_start|>assistant\n", "Seven is prime.<|im_end|>")
    ]


def test_changing_the_chat_template_does_not_reuse_the_tokenized_cache(tmp_path, datasets_cache):
    tokenizer, _ = family("llama3")
    rows = [{"messages": TURNS}]
    first, _ = encode_file(tmp_path, datasets_cache, tokenizer, rows, template=Template.chat)
    other = LLAMA3.replace("<|eot_id|>", "<|end_header_id|>")
    second, _ = encode_file(tmp_path, datasets_cache, tokenizer, rows, template=Template.chat, chat_template=other)
    assert first[0]["input_ids"] != second[0]["input_ids"]


def test_plain_text_trains_on_every_token_and_ends_with_eos(tmp_path, datasets_cache):
    tokenizer = build_tokenizer(compose_config([]).model)
    rows = [{"text": "The quick brown fox jumps over the lazy dog."}, {"body": "x"}]
    with pytest.raises(ValueError, match=r"rows\.jsonl:2: missing field 'text'"):
        encode_file(tmp_path, datasets_cache, tokenizer, rows, template=Template.text)
    data, _ = encode_file(tmp_path, datasets_cache, tokenizer, rows[:1], template=Template.text)
    expected = [*tokenizer(rows[0]["text"], add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    assert data[0]["input_ids"] == expected and data[0]["labels"] == expected


def test_a_chat_template_setting_that_is_neither_a_file_nor_a_template_fails_before_training() -> None:
    from ddptrain.config import ConfigError

    with pytest.raises(ConfigError, match=r"data\.chat_template=no/such\.jinja: no such file"):
        compose_config(["data=tiny_chat", "data.chat_template=no/such.jinja"])
    assert compose_config(["data=tiny_chat", "data.chat_template=chatml"]).data.chat_template == "chatml"


def test_plain_text_packs_and_trains_with_every_token_a_target(tmp_path) -> None:
    """data.template=text with data.batching=packed through the real Trainer: each packed row's labels are its
    input ids everywhere but at each sample's first position (never predicted from the sample before)."""
    import math

    from ddptrain import parallel
    from ddptrain.trainer import Trainer

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()
    lines = [" ".join(words[i % 7 : i % 7 + 3 + i % 5]) + f" number {i}." for i in range(40)]
    path = tmp_path / "text.jsonl"
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    overrides = ["parallel=single", "trainer.progress_bar=false", "trainer.max_steps=3", "trainer.save_final=false"]
    data = [
        f"data.path={path}",
        "data.template=text",
        "data.batching=packed",
        "data.max_tokens_per_batch=64",
        "data.max_length=64",
    ]
    cfg = compose_config([*overrides, *data, "data.eval_fraction=0", f"data.cache_dir={tmp_path / 'cache'}"])
    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device)
    try:
        trainer = Trainer(cfg, env, tmp_path)
        seen, collate = [], trainer.loader.collate_fn
        trainer.loader.collate_fn = lambda rows: seen.append(collate(rows)) or seen[-1]
        record = trainer.fit()
    finally:
        parallel.teardown()
    assert len(seen) == 3 and math.isfinite(record["loss"])
    for batch in seen:
        first_of_sample = batch["position_ids"] == 0
        assert bool(((batch["labels"] == batch["input_ids"]) | first_of_sample).all())
        assert int((batch["labels"] == IGNORE_INDEX).sum()) == int(first_of_sample.sum())


def test_changing_which_field_holds_the_turns_does_not_reuse_the_tokenized_cache(tmp_path, datasets_cache):
    tokenizer, _ = family("llama3")
    short = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]
    long = [{"from": "human", "value": "Hi there, how are you?"}, {"from": "gpt", "value": "Very well, thanks."}]
    rows = [{"conversations": short, "dialog": long}]
    first, _ = encode_file(tmp_path, datasets_cache, tokenizer, rows, template=Template.sharegpt)
    second, _ = encode_file(
        tmp_path, datasets_cache, tokenizer, rows, template=Template.sharegpt, conversations_field="dialog"
    )
    assert len(second[0]["input_ids"]) > len(first[0]["input_ids"])
