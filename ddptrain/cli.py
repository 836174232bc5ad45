"""The ``ddptrain`` command: every verb, its help and where its code lives, in one place.

    ddptrain train [overrides]        fine-tune (a bare ``ddptrain [overrides]`` trains too)
    ddptrain preview|plan|report|diagnose|export ...

``python -m ddptrain`` and ``torchrun ... -m ddptrain`` come here too, and each ``python -m ddptrain.<verb>`` form
runs the same ``main`` as ``ddptrain <verb>``: the verb modules build their parsers with ``verb_parser`` (so both
forms print the same help), and this module finds them by name (importing them here would load torch for
``--help``). Nothing here imports torch; ``train`` lives in ``__main__.py``.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys
import textwrap
from dataclasses import dataclass
from importlib import metadata

from ddptrain.config.hydra import CONF_DIR as _CONF_DIR

CONF_DIR = str(_CONF_DIR)
WHAT_IT_IS = (
    "ddptrain: fine-tune language models (LoRA or full) on one or many GPUs with PyTorch DDP or FSDP2, "
    "configured with Hydra."
)


@dataclass(frozen=True)
class Verb:
    module: str
    """Where the verb's ``main(argv)`` lives; ``python -m`` runs it as ``python_m``."""
    summary: str
    example: str
    python_m: str
    function: str = "main"
    overrides: bool = False
    """Takes Hydra overrides: shell completion completes them after the verb."""

    def run(self, argv: list[str]) -> int:
        code = getattr(importlib.import_module(self.module), self.function)(argv)
        return int(code or 0)


VERBS: dict[str, Verb] = {
    "train": Verb(
        "ddptrain.__main__",
        "fine-tune: compose the config from overrides, start the workers, train, evaluate, save",
        "ddptrain train parallel=ddp4 model=qwen7b_lora\n  ddptrain train -m optim.grad_accum_steps=1,2,4",
        "ddptrain",
        function="train",
        overrides=True,
    ),
    "preview": Verb(
        "ddptrain.preview",
        "show training samples as the model sees them, trained tokens marked, and the batch plan",
        "ddptrain preview data=tiny_chat --n 1",
        "ddptrain.preview",
        overrides=True,
    ),
    "plan": Verb(
        "ddptrain.plan.__main__",
        "predict every rank's peak memory before a run starts, and the levers if it does not fit",
        "ddptrain plan model=qwen7b_lora parallel=ddp4 trainer.device=cuda plan.device_memory_gb=80",
        "ddptrain.plan",
        overrides=True,
    ),
    "report": Verb(
        "ddptrain.sweep.report",
        "compare the jobs of a sweep: report.md, report.csv and plots in the sweep folder",
        "ddptrain report outputs/multirun/2026-12-01_10-00-00-000000",
        "ddptrain.report",
    ),
    "diagnose": Verb(
        "ddptrain.diagnose.cli",
        "a run's report: where each step's time went, what bounds it, the levers; --what-if for more GPUs",
        "ddptrain diagnose outputs/2026-12-01_10-00-00-000000 --what-if parallel.nproc_per_node=8 link=nvlink",
        "ddptrain.diagnose",
    ),
    "export": Verb(
        "ddptrain.export",
        "write a run or checkpoint as a peft adapter, or (--merge) a merged model plain transformers loads",
        "ddptrain export outputs/2026-12-01_10-00-00-000000 exported/adapter --merge",
        "ddptrain.export",
    ),
}


def verb_parser(verb: str, description: str = "") -> argparse.ArgumentParser:
    """The argument parser of ``ddptrain <verb>``: its name, what it does, where else it runs, an example."""
    entry = VERBS[verb]
    paragraphs = [f"{entry.summary[0].upper()}{entry.summary[1:]}.", description, f"Also: python -m {entry.python_m}"]
    return argparse.ArgumentParser(
        prog=f"ddptrain {verb}",
        description="\n\n".join(textwrap.fill(text, 100) for text in paragraphs if text),
        epilog=f"example:\n  {entry.example}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def overview() -> str:
    """``ddptrain --help``."""
    width = max(map(len, VERBS))
    verbs = "\n".join(f"  {name:<{width}}  {verb.summary}" for name, verb in VERBS.items())
    groups = "\n".join(
        f"  {group.name:<9} {', '.join(sorted(p.stem for p in group.glob('*.yaml')))}"
        for group in sorted(_CONF_DIR.iterdir())
        if group.is_dir() and group.name != "hydra"
    )
    return (
        f"{WHAT_IT_IS}\n\n"
        "usage: ddptrain <verb> [options] [overrides]\n"
        "       ddptrain [overrides]                 (trains, as ddptrain train)\n"
        "       torchrun --nproc_per_node N -m ddptrain [overrides]\n\n"
        f"verbs:\n{verbs}\n\n"
        f"config groups (pick one with group=option, set any key with group.key=value):\n{groups}\n\n"
        "examples:\n"
        "  ddptrain train                             the bundled tiny model and data, 2 CPU processes\n"
        "  ddptrain train parallel=ddp4 model=llama3_1_8b_lora data=alpaca data.path=alpaca.jsonl\n"
        "  ddptrain train -m optim.grad_accum_steps=1,2,4 trainer.precision=bf16,fp16\n\n"
        "`ddptrain <verb> --help` for a verb's options; `ddptrain train --help` lists every config key.\n"
        "Docs: README.md (the project's front page) and docs/ in the source tree."
    )


def main(argv: list[str] | None = None) -> int:
    """``ddptrain [verb] ...``: a verb runs its ``main``; anything else (overrides, ``-m``, Hydra's flags) trains."""
    argv = sys.argv[1:] if argv is None else argv
    first = argv[0] if argv else ""
    if first in ("-h", "--help"):
        print(overview())
        return 0
    if first == "--version":
        print(f"ddptrain {metadata.version('ddptrain')}")
        return 0
    if first in VERBS:
        rest = argv[1:]
        if VERBS[first].overrides and rest and _bare_word(rest[0]):  # `ddptrain train plna`: no override, no option
            sys.exit(f"ddptrain {first}: {rest[0]!r} is not a key=value override (nor an option).")
        return VERBS[first].run(rest)
    if _bare_word(first):
        close = difflib.get_close_matches(first, VERBS, n=1)
        hint = f"did you mean `ddptrain {close[0]}`? " if close else ""
        sys.exit(f"ddptrain: {first!r} is neither a verb nor a key=value override; {hint}verbs: {', '.join(VERBS)}.")
    return VERBS["train"].run(argv)


def _bare_word(word: str) -> bool:
    """Neither an option nor a Hydra override (``key=value``, ``+key=value``, ``~key``)."""
    return bool(word) and not word.startswith(("-", "+", "~")) and "=" not in word


def completion_line(line: str) -> str | None:
    """``COMP_LINE`` as Hydra's shell completion should read it (Hydra strips only the program's name): the verb
    taken out where it takes overrides (``ddptrain plan model=<TAB>``); None where it takes none, or while the verb
    itself is being typed (nothing to suggest: the shell completes file names)."""
    match = re.match(r"(\s*\S+\s+)(\S+)(\s.*)?$", line, re.S)
    if not match or match.group(2) not in VERBS:
        return line
    if not VERBS[match.group(2)].overrides or match.group(3) is None:
        return None
    return match.group(1) + match.group(3).lstrip()
