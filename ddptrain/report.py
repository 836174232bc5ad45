"""``python -m ddptrain.report SWEEP_DIR``: the sweep report (``ddptrain/sweep/report.py``) from a sweep folder.

A thin entry that stays at the package's top level because ``python -m ddptrain.report`` is the documented command
(README, docs, the sweep's own closing line); the report itself lives in ``sweep/report.py``.
"""

import sys

from ddptrain.sweep.report import main

if __name__ == "__main__":
    sys.exit(main())
