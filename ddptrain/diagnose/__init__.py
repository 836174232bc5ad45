"""The run's diagnosis: where each optimizer step's time went, what bounds the run, and what to change.

``build_report`` reads a run folder (``metrics.jsonl`` and ``config.yaml``) and returns a verdict with the numbers
behind it, the levers to pull as config keys the user types, ordered by expected gain, and a tokens/s prediction
for each lever whose effect follows from what was measured. ``write_report`` adds ``report.md``, ``report.json``
and PNG plots to the run folder. ``what_if`` estimates another number of processes from a ring all-reduce model.
The rules, the prediction formulas and the bandwidth table are written out in docs/diagnostics.md.

Run it on a folder: ``ddptrain diagnose RUN_DIR [--what-if parallel.nproc_per_node=8 link=nvlink]``.
Neither torch nor matplotlib is imported at module import: a copied run folder is enough to diagnose it.

The package, in the order of the pipeline: ``runs`` reads the run folder into averaged figures and the step model;
``rules`` turns them into findings and the verdict; ``levers`` into the config changes to make, with predictions;
``report`` puts these together (``build_report``); ``scaling`` is the what-if; ``render`` writes report.md,
report.json, the plots and the console summary; ``cli`` is the command line.
"""

from ddptrain.diagnose.cli import main
from ddptrain.diagnose.render import console_summary, format_what_if, render_markdown, write_report
from ddptrain.diagnose.report import build_report
from ddptrain.diagnose.rules import VERDICTS
from ddptrain.diagnose.runs import DiagnoseError
from ddptrain.diagnose.scaling import LINKS, ring_allreduce_s, what_if

__all__ = [
    "LINKS",
    "VERDICTS",
    "DiagnoseError",
    "build_report",
    "console_summary",
    "format_what_if",
    "main",
    "render_markdown",
    "ring_allreduce_s",
    "what_if",
    "write_report",
]
