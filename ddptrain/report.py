"""``python -m ddptrain.report SWEEP_DIR``, as ``ddptrain report``: the sweep report (``ddptrain/sweep/report.py``).

The one verb whose code lives in a package of another name (``sweep/``): this module keeps its ``python -m`` form.
"""

import sys

from ddptrain.sweep.report import main

if __name__ == "__main__":
    sys.exit(main())
