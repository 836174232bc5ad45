"""Moved to ``ddptrain.process.started``. Kept only because ``ddptrain/parallel.py`` imports ``ddptrain.started`` and
is being changed concurrently on main (issue 22): delete this file once parallel.py imports
``ddptrain.process.started``."""

from ddptrain.process.started import Start

__all__ = ["Start"]
