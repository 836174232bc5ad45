"""Every model preset of issue 41 trains a 2-rank step, at random init, cut to 2 layers and narrowed
(``tests/presets.py``), on a two-turn conversation in a chat template of its family: the ids trained on are
``apply_chat_template``'s, the trained tokens are the replies and their end-of-turn markers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ddptrain.launch import launch
from tests.conftest import compose_config
from tests.distributed.workers_presets import train_each_preset
from tests.presets import PRESETS, write_narrowed
from tests.unit.test_chat_templates import LAST_REPLY_END, LAST_REPLY_START, TURNS, family, target_runs

pytestmark = pytest.mark.dist


def preset_overrides(preset: str, tmp_path: Path, data: Path) -> list[str]:
    tokenizer, _ = family(PRESETS[preset][0])
    tokenizer_dir = tmp_path / "tokenizers" / PRESETS[preset][0]
    if not tokenizer_dir.is_dir():
        tokenizer.save_pretrained(tokenizer_dir)  # its family's chat template and control tokens with it
    return [
        f"model={preset}",
        "model.init=random",
        f"model.config_path={write_narrowed(preset, tmp_path / 'configs' / preset)}",
        f"model.tokenizer={tokenizer_dir}",
        "model.dtype=fp32",
        f"data.path={data}",
        "data.template=chat",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.eval_fraction=0",
        "data.micro_batch_size=2",
        "trainer.max_steps=1",
        "trainer.save_final=false",
        "trainer.progress_bar=false",
        "parallel.timeout_s=120",
        f"trainer.output_dir={tmp_path}",
    ]


def test_every_preset_trains_a_2_rank_step_on_its_familys_chat_template(tmp_path: Path) -> None:
    data = tmp_path / "two_turns.jsonl"
    data.write_text((json.dumps({"messages": TURNS}) + "\n") * 8)
    run_dir = tmp_path / "run"
    (run_dir / "presets").mkdir(parents=True)
    for preset in PRESETS:
        cfg = compose_config(preset_overrides(preset, tmp_path, data))
        OmegaConf.save(OmegaConf.structured(cfg), run_dir / "presets" / f"{preset}.yaml")
    results = launch(compose_config(["parallel.timeout_s=120"]), run_dir, entrypoint=train_each_preset)

    assert sorted(results) == sorted(PRESETS)
    for preset, result in results.items():
        name = PRESETS[preset][0]
        tokenizer, reply_end = family(name)
        assert result["last"]["step"] == 1 and math.isfinite(result["last"]["loss"]), preset
        assert result["input_ids"] == tokenizer.apply_chat_template(TURNS, tokenize=True)["input_ids"], preset
        replies = [reply_end.format(m["content"]) for m in TURNS if m["role"] == "assistant"]
        replies[-1] = LAST_REPLY_START.get(name, "") + replies[-1] + LAST_REPLY_END.get(name, "")
        assert target_runs(result["input_ids"], result["labels"], tokenizer) == replies, preset
        ranks = [json.loads((run_dir / preset / f"rank{r}.json").read_text()) for r in (0, 1)]
        assert ranks[0]["digest"] == ranks[1]["digest"], f"{preset}: the ranks' adapters differ after the step"
        assert ranks[0]["moved"] == ranks[0]["lora_B"] > 0, f"{preset}: an adapter the step did not train"
