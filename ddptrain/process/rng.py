"""Random streams: each rank's own seeding for training (dropout), and the capture and restore that let a resumed
run draw exactly what the uninterrupted one would have (checkpoints keep them per rank, ``RNGState``)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


class RNGState:
    """This process's RNG streams as a stateful part (dropout masks continue exactly on resume)."""

    def state_dict(self) -> dict[str, Any]:
        return capture_rng()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_rng(state)


def seed_rng(seed: int, rank: int) -> None:
    """Give this rank's training its own random streams (torch, CUDA, Python ``random``, numpy).

    The model is built before this from ``seed`` alone, so every rank starts from the same weights. What
    draws during training (dropout, ``model.lora_dropout``) then draws from these: with one stream for all
    ranks, every rank would apply rank 0's masks to its own samples. ``capture_rng`` keeps them per rank.
    """
    # SeedSequence mixes the pair: with seed + rank, rank 1 of seed 42 would replay rank 0 of seed 43.
    words = np.random.SeedSequence([seed, rank]).generate_state(2)
    torch.manual_seed(int(words[0]) << 32 | int(words[1]))  # every CUDA device too
    random.seed(int(words[0]))
    np.random.seed(words)


def capture_rng() -> dict[str, Any]:
    """This process's RNG states as tensors and plain numbers (safe for ``weights_only`` loading)."""
    numpy_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what ``capture_rng`` saved (dropout masks then continue exactly)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
            "has_gauss": n["has_gauss"],
            "gauss": n["gauss"],
        }
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@contextlib.contextmanager
def rng_untouched() -> Iterator[None]:
    """Whatever the body draws, every stream continues afterwards as if it had not run. A save's check builds and
    loads models, whose initialisation draws (and a random base is drawn from a seed): a run resumed from that
    checkpoint must draw the same dropout masks as the run that went on from it."""
    state = capture_rng()
    try:
        yield
    finally:
        restore_rng(state)
