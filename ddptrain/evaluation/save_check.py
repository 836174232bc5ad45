"""Proof that each save loads as trained, at the cost it is worth (``trainer.save_check``).

Rank 0 checks the weights it writes (a checkpoint's ``weights/``, ``adapter/``) before the folder is put in place, in
two ways:

- **the read-back** (``readback``): the files as written are read back and compared bit for bit with the live
  trainable tensors (an adapter: ``get_peft_model_state_dict`` of the training model), under canonical keys, none
  missing and none extra; an adapter's ``adapter_config.json`` names the base the run trains on and its LoRA
  settings. Exact, and it costs one read of the files.
- **the round trip**: the folder loads as a user loads it, with nothing of ddptrain on the load path, and computes
  what the training model computes: an adapter through plain peft onto the base it names, its logits, and the merged
  model's weights (``peft_check``); a full fine-tune through ``AutoModelForCausalLM.from_pretrained``, bit for bit
  (``full_check``). It loads the base again: 2.4 s for Qwen2.5-0.5B on this project's CPU machine, against 0.04 s
  for its read-back (bench/README.md).

``trainer.save_check`` says which runs when:

- ``every`` (the default): the read-back at every save; the round trip too at the final save: ``adapter/``, or, with
  ``trainer.save_final=false``, the checkpoint of the last step (a run that saved any checkpoint saves that one too,
  ``Trainer.finish``). What the files hold is proven at each save, that plain peft computes the trained function
  from such files once, at the end.
- ``full``: the read-back and the round trip at every save (a GPU run keeps its host copy of the base between
  checks, where host memory allows it).
- ``final``: the read-back and the round trip at the final save; before it, the read-back of a save that becomes
  ``best/`` only (the copy is verified against what that read-back proved).
- ``off``: nothing.

``best/`` is a verified copy, never checked twice: the files of the checkpoint it copies were read back when they
were written (in every mode but off) and listed with their SHA-256 in its manifest, and each copied file must hash the
same. A failure raises ``SaveCheckError`` naming the file, the key and the fix; the save fails and the previous
checkpoint stays in place.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddptrain.checkpoint.files import WEIGHTS, read_manifest, sha256_file
from ddptrain.config import SaveCheckMode
from ddptrain.evaluation.full_check import FullWeightsCheck
from ddptrain.evaluation.peft_check import PeftRoundTrip, Probe
from ddptrain.evaluation.readback import ReadBack, SaveCheckError

__all__ = ["SaveCheckError", "SaveChecks", "build_save_checks", "merge_records"]

log = logging.getLogger("ddptrain.checkpoint")


class SaveChecks:
    """What rank 0 proves of each save, as ``trainer.save_check`` says.

    Args:
        mode: ``trainer.save_check`` (not off: a run without checks holds none).
        read_back: the exact read-back of the files.
        round_trip: the load through plain peft (``PeftRoundTrip``) or transformers (``FullWeightsCheck``).
    """

    def __init__(self, mode: SaveCheckMode, read_back: ReadBack, round_trip: PeftRoundTrip | FullWeightsCheck):
        assert mode != SaveCheckMode.off, "trainer.save_check=off: build no SaveChecks"
        self.mode, self.read_back, self.round_trip = mode, read_back, round_trip

    def written(
        self,
        folder: Path,
        shown: Path,
        final: bool,
        best: bool = False,
        whole: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, Any]:
        """Check the weights just written to ``folder`` (``shown``: where the user will find them); ``final``: the last
        save of the run; ``best``: they are copied to ``best/`` next (``copied`` trusts what is checked here);
        ``whole``: a sharded model's trainable tensors, gathered whole (FSDP2), checked against instead of its own.

        Returns:
            The record of the check (empty when the mode checks nothing at this save): its seconds, the folders read
            back and the tensors compared, and the round trip's record when it ran.

        Raises:
            SaveCheckError: naming the file and what is wrong with it.
        """
        if self.mode == SaveCheckMode.final and not (final or best):
            return {}
        start = time.perf_counter()
        given = {} if whole is None else {"whole": whole}
        tensors = self.read_back(folder, shown, **given)
        log.info("save check: %s read back as trained, bit for bit (%d tensors)", shown, tensors)
        record: dict[str, Any] = {"save_check_folders": [str(shown)], "save_check_tensors": tensors}
        if final or self.mode == SaveCheckMode.full:
            record |= self.round_trip([(folder, shown)], **given)
        return {"save_check_s": time.perf_counter() - start, **record}

    def copied(self, checkpoint: Path, folder: Path, shown: Path) -> dict[str, Any]:
        """Check the copy in ``folder`` (``shown``: ``best/``) of a checkpoint's weights: every file of the checkpoint's
        ``weights/`` hashes as its manifest lists it (the files the read-back checked when they were written), and it
        lists at least one.

        Returns:
            The record: its seconds and the folder.

        Raises:
            SaveCheckError: a file missing from the copy or differing from the checkpoint's, or a manifest that lists
                no weights.
        """
        start = time.perf_counter()
        prefix = f"{WEIGHTS}/"
        files = read_manifest(checkpoint)["files"]
        listed = {k.removeprefix(prefix): v for k, v in files.items() if k.startswith(prefix)}
        if not listed:
            raise SaveCheckError(
                f"{checkpoint / 'manifest.json'} lists no file under {WEIGHTS}/: there is nothing to verify {shown} "
                "against, and no checked weights to copy. The checkpoint is incomplete or not one ddptrain wrote."
            )
        for name, info in listed.items():
            copy = folder / name
            if not copy.is_file() or copy.stat().st_size != info["bytes"] or sha256_file(copy) != info["sha256"]:
                raise SaveCheckError(
                    f"{shown / name} is not the copy of {checkpoint / WEIGHTS / name} (missing, or its bytes differ "
                    "from the ones its manifest lists): best/ would not hold the weights checked at that save. Check "
                    f"the storage under {shown.parent}; the checkpoint itself is intact."
                )
        seconds = time.perf_counter() - start
        log.info("save check: %s holds the checked files of %s, byte for byte", shown, checkpoint)
        return {"save_check_s": seconds, "save_check_copies": [str(shown)]}


def merge_records(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two check records of one save as one: seconds, counts and folders added up, the worst differences and shares."""
    merged = dict(first)
    for key, value in second.items():
        if key not in merged:
            merged[key] = value
        elif key.endswith(("_diff", "_share", "_threads", "_kept")):
            merged[key] = max(merged[key], value)
        else:
            merged[key] = merged[key] + value
    return merged


def build_save_checks(
    mode: SaveCheckMode,
    model: nn.Module,
    base: str | None,
    dtype: torch.dtype,
    attn: str,
    probe_rows: list[list[int]],
    pad_id: int,
    on_gpu: bool,
) -> SaveChecks | None:
    """The checks of ``trainer.save_check`` for the run's mode (None when off): the read-back, and the round trip of
    an adapter through peft on a probe of ``probe_rows`` or of a full fine-tune's model through transformers.

    Args:
        mode: ``trainer.save_check``.
        model: the training model, unwrapped (the peft model for LoRA).
        base: the base an adapter names (``checkpoint.files.base_model_path``); None for a full fine-tune.
        dtype: ``model.dtype`` as a torch dtype.
        attn: ``model.attn_implementation``.
        probe_rows: a few training rows (token ids) for the LoRA round trip's probe batch.
        pad_id: the tokenizer's pad id.
        on_gpu: the run trains on a GPU: the LoRA round trip loads its copy of the base on the host (the device may
            have no room for a second one), and with ``full`` keeps it there between checks; the full fine-tune's
            always loads on the host.
    """
    if mode == SaveCheckMode.off:
        return None
    lora = hasattr(model, "peft_config")
    if lora:
        probe = Probe.from_rows(list(probe_rows), pad_id)
        # Only then does another check follow that could use it, and only on the host: on a CPU run the copy would
        # stay on the training device through every later step, where the memory plan counts it only while a check runs.
        keep = mode == SaveCheckMode.full and on_gpu
        round_trip: PeftRoundTrip | FullWeightsCheck = PeftRoundTrip(model, probe, dtype, attn, on_gpu, keep)
    else:
        round_trip = FullWeightsCheck(model, dtype)
    return SaveChecks(mode, ReadBack(model, base if lora else None), round_trip)
