"""What the checks of every config group share: the positive-count rule, and the facts about this machine that a
few checks need, each asked only when a check needs it (the config check must not import torch: a typo fails in
well under a second).

The checks call these through the module (``checks._cuda_available()``), so a test that pretends CUDA is there patches
one name here and every group's check sees it.
"""

from __future__ import annotations

import os
import re
from typing import Any


def _positive(values: dict[str, Any]) -> list[str]:
    return [f"{key}={v} must be a positive integer." for key, v in values.items() if v is not None and v < 1]


def _looks_local(path: str) -> bool:
    return os.path.exists(os.path.expanduser(path))


def _cuda_available() -> bool:
    # Imported here, and only for the checks that need it: torch takes seconds to import.
    import torch

    return torch.cuda.is_available()


def installed_torch_version() -> tuple[int, int] | None:
    """(major, minor) of the installed torch, read from its package metadata: importing torch takes seconds."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = re.match(r"(\d+)\.(\d+)", version("torch"))
    except PackageNotFoundError:
        return None
    return (int(found.group(1)), int(found.group(2))) if found else None
