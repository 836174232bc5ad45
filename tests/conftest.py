"""Shared test helpers: paths, config composition, subprocess runs of the real entrypoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from ddptrain.__main__ import CONF_DIR
from ddptrain.config import RunConfig, register_configs, to_run_config

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"
ALPACA = SHARED_DATA / "alpaca" / "alpaca_data_52k.jsonl"
QWEN2_TOKENIZER = SHARED_DATA / "tokenizers" / "qwen2"

requires_shared = pytest.mark.skipif(not ALPACA.exists(), reason="needs ../shared/data (Alpaca, Qwen2 tokenizer)")

# One thread per rank: the CI machine has 2 cores and the tests run 2 ranks.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def compose_config(overrides: list[str], config_name: str = "train", config_dir: Path | None = None) -> RunConfig:
    """Compose and validate a run config as ``python -m ddptrain [--config-dir DIR --config-name NAME]`` does."""
    register_configs()
    primary_dir = CONF_DIR
    if config_dir is not None:  # like --config-dir: the recipe is primary, conf/ stays on the search path
        primary_dir = str(config_dir)
        overrides = [*overrides, f"hydra.searchpath=[file://{CONF_DIR}]"]
    with initialize_config_dir(primary_dir, version_base="1.3"):
        return to_run_config(compose(config_name, overrides=overrides))


@pytest.fixture(scope="session")
def datasets_cache(tmp_path_factory) -> Path:
    """One datasets cache for the session: hermetic, yet each file is converted only once."""
    return tmp_path_factory.mktemp("datasets-cache")


def run_ddptrain(
    args: list[str], timeout: float = 300, launcher: list[str] | None = None
) -> subprocess.CompletedProcess:
    """Run the real entrypoint in a subprocess (``python -m ddptrain`` unless ``launcher`` says otherwise)."""
    command = (launcher or [sys.executable]) + ["-m", "ddptrain", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("MASTER_PORT", None)
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_dirs(output_dir: Path) -> list[Path]:
    """Run folders (hidden bookkeeping such as .torchrun/ excluded)."""
    return sorted(p for p in output_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
