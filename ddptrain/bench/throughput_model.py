"""The benchmark model, shared by ``throughput.py`` and ``throughput_memory.py``.

A 4-layer, 256-wide Qwen2 with the real 151,936-token vocabulary, random weights from one seed,
LoRA r=LORA_RANK on every linear layer.
"""

from __future__ import annotations

import json
from pathlib import Path

# The benchmark model: Qwen2 proportions (GQA 2:1, SwiGLU), 4 layers x 256 wide, real vocabulary.
MODEL_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "use_cache": False,
    "use_sliding_window": False,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "torch_dtype": "float32",
}
LORA_RANK = 16


def write_model_config(workdir: Path) -> Path:
    """The benchmark model's architecture as a folder that ``model.config_path`` can point at."""
    folder = workdir / "model"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(MODEL_CONFIG, indent=2))
    return folder
