"""The model presets of issue 41 as the tests build them: each preset's architecture config cut to 2 layers and
narrowed (the same kind of model, its quirks kept: tied or untied head, grouped KV heads, Gemma 2's soft caps and
eager attention, Phi-3's fused projections and LongRoPE), and the chat-template family each preset's tokenizer
speaks (``tests/unit/test_chat_templates.py``'s templates)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import REPO

CONF_MODEL = REPO / "conf" / "model"
# preset -> (chat family in test_chat_templates.family, parameters of the public model at full size)
PRESETS = {
    "llama3_1_8b_lora": ("llama3.1", 8_030_261_248),
    "llama3_2_1b_lora": ("llama3.1", 1_235_814_400),
    "llama3_2_3b_lora": ("llama3.1", 3_212_749_824),
    "mistral7b_v0_3_lora": ("mistral-v0.3", 7_248_023_552),
    "gemma2_2b_lora": ("gemma", 2_614_341_888),
    "gemma2_9b_lora": ("gemma", 9_241_705_984),
    "phi3_5_mini_lora": ("phi3", 3_821_079_552),
    "qwen3_0_6b_lora": ("qwen3", 596_049_920),
    "qwen3_8b_lora": ("qwen3", 8_190_735_360),
}
# Every preset the tests above do not cover, with where it is covered instead.
COVERED_ELSEWHERE = {"tiny_qwen2": "every test", "qwen2_5_0_5b_lora": "test_plan", "qwen7b_lora": "test_plan"}
NARROW_VOCAB = 4352  # above the bundled tokenizer's 4,000 ids and every family's added control tokens


def asset_config(preset: str) -> dict:
    """The preset's shipped config.json (``config_path: ${asset:model_configs/<name>}``)."""
    line = next(x for x in (CONF_MODEL / f"{preset}.yaml").read_text().splitlines() if x.startswith("config_path:"))
    name = line.split("model_configs/")[1].split("}")[0]
    return json.loads((REPO / "ddptrain" / "assets" / "model_configs" / name / "config.json").read_text())


def narrowed(preset: str) -> dict:
    """2 layers of 2 query heads of the preset's own head size (Phi-3's LongRoPE factors are per head dimension);
    grouped KV stays grouped (1 KV head), a model without grouping keeps 2."""
    config = dict(asset_config(preset))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    grouped = config["num_key_value_heads"] < config["num_attention_heads"]
    config.update(
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1 if grouped else 2,
        hidden_size=64 if "head_dim" in config else 2 * head_dim,
        intermediate_size=128,
        vocab_size=NARROW_VOCAB,
        max_window_layers=2,
    )
    # The narrow vocabulary's ids come from the test's tokenizer (null: Phi-3's default pad id 32000 is out of range)
    config.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return config


def write_narrowed(preset: str, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(narrowed(preset)))
    return folder
