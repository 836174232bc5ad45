"""Turn a run or a checkpoint into folders that plain transformers / peft load.

    ddptrain export outputs/<run> exported/adapter            # peft adapter + tokenizer
    ddptrain export outputs/<run>/checkpoints/step-00000500 exported/merged --merge

Without ``--merge``: an adapter folder for ``PeftModel.from_pretrained(base, folder)``.
With ``--merge``: the LoRA weights folded into the base model, saved as a full model that
``AutoModelForCausalLM.from_pretrained(folder)`` loads alone (inference servers), plus the
tokenizer. The base model comes from the run's config (``model.name_or_path``), or from the
run's ``base/`` folder for a randomly initialised model.

A full fine-tune (``model.lora=false``) saved the whole model: with or without ``--merge`` the export is that
model and the tokenizer, a folder ``AutoModelForCausalLM.from_pretrained(folder)`` loads alone. A head tied to the
input embedding is not in the files (``save_pretrained`` leaves it out): the config's ``tie_word_embeddings`` ties
it back when the folder loads.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from omegaconf import OmegaConf

from ddptrain import checkpoint
from ddptrain.checkpoint.files import what_the_run_saved
from ddptrain.cli import verb_parser
from ddptrain.config import RunConfig, register_configs
from ddptrain.model import build_tokenizer, point_adapter_at_base
from ddptrain.model.precision import TORCH_DTYPES
from ddptrain.observe.console import quiet_libraries


def locate(source: Path) -> tuple[Path, Path]:
    """(run directory, folder with the trainable weights) for a run or a ``checkpoints/step-N`` folder.

    Raises:
        checkpoint.CheckpointError: nothing exportable there.
    """
    if (source / checkpoint.MANIFEST).is_file():
        checkpoint.verify(source)
        return source.parent.parent, source / checkpoint.WEIGHTS
    if (source / "adapter").is_dir():
        return source, source / "adapter"
    newest = checkpoint.newest_complete(source / "checkpoints")
    if newest is None:
        raise checkpoint.CheckpointError(
            f"{source}: not a checkpoint, and no adapter/ folder or complete checkpoint under it: pass as source "
            "a run directory of python -m ddptrain (outputs/<run>) or one of its checkpoints/step-N folders."
        )
    return source, newest / checkpoint.WEIGHTS


def load_run_config(run_dir: Path) -> RunConfig:
    """The resolved config a run saved in ``config.yaml``, typed.

    Raises:
        checkpoint.CheckpointError: the run directory has no ``config.yaml``.
    """
    register_configs()
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise checkpoint.CheckpointError(
            f"{run_dir} has no config.yaml, which python -m ddptrain writes into every run directory: pass as "
            "source a run directory it made (or a checkpoints/step-N folder inside one), not a copy of the weights."
        )
    merged = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.load(saved))
    return OmegaConf.to_object(merged)


def export(source: Path, out: Path, merge: bool) -> Path:
    """Write the export to ``out`` (replacing it atomically) and return ``out``: an adapter, a merged model, or a
    full fine-tune's model (with or without ``merge``), each with the tokenizer."""
    run_dir, weights = locate(source)
    cfg = load_run_config(run_dir)
    tokenizer = build_tokenizer(cfg.model)
    base = checkpoint.base_model_path(cfg.model, run_dir)

    def write(tmp: Path) -> None:
        if merge and cfg.model.lora:
            from peft import PeftModel
            from transformers import AutoModelForCausalLM

            base_model = AutoModelForCausalLM.from_pretrained(base, dtype=TORCH_DTYPES[cfg.model.dtype])
            merged = PeftModel.from_pretrained(base_model, weights).merge_and_unload()
            merged.save_pretrained(tmp, safe_serialization=True)
        else:
            for file in weights.iterdir():
                shutil.copy2(file, tmp / file.name)
            if cfg.model.lora:
                point_adapter_at_base(tmp, base)
        tokenizer.save_pretrained(tmp)

    checkpoint.atomic_save_dir(out, write)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = verb_parser(
        "export",
        "Without --merge: a folder for PeftModel.from_pretrained(base, folder). A full fine-tune "
        "exports the whole model either way.",
    )
    parser.add_argument("source", type=Path, help="a run directory or a checkpoints/step-N folder")
    parser.add_argument("out", type=Path, help="folder to write (replaced if it exists)")
    parser.add_argument("--merge", action="store_true", help="fold LoRA into the base: a full transformers model")
    args = parser.parse_args(argv)
    quiet_libraries()
    try:
        out = export(args.source, args.out, args.merge)
    except (checkpoint.CheckpointError, FileNotFoundError) as err:
        sys.exit(f"ddptrain.export: {err}")
    kind = "merged model" if args.merge else "adapter"
    if what_the_run_saved(locate(args.source)[0]) == "weights":  # a full fine-tune: nothing to merge
        kind = "fully fine-tuned model"
    print(f"ddptrain.export: wrote the {kind} to {out}")


if __name__ == "__main__":
    main()
