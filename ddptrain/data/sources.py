"""Where ``data.path`` (and ``data.eval_path``) point: a file, a glob of files, a folder or a Hub dataset id.

``resolve_source`` tells them apart with the standard library alone, so that ``config/data.py`` can refuse a
local path that does not exist before any worker starts; ``load.py`` then reads the source through
``datasets``. A path that does not exist locally and looks like ``owner/name`` is a Hub dataset id:
whether the Hub (or, offline, the local cache) has it is only known when it is loaded.
``locate_row`` and ``source_group`` say, for errors, where a row sits (``file:line``) and where a source's
keys live.
"""

from __future__ import annotations

import glob
import itertools
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

# File type -> the datasets builder that reads it.
FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
SUPPORTED = ".json, .jsonl, .parquet or .csv"
# A missing path with one of these endings was meant as a local file, not a Hub id.
DATA_SUFFIXES = {*FORMATS, ".txt", ".tsv", ".arrow"}
# Hub ids: "name" or "owner/name" (letters, digits, "-", "_", "."), optionally pinned to a revision after "@"
# (a branch, a tag or a commit: owner/name@v1.0, owner/name@refs/convert/parquet).
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?)(@(?P<revision>[\w.][\w./-]*))?")


class SourceKind(str, Enum):
    file = "file"  # one data file
    glob = "glob"  # the files a pattern matches, of one type, in sorted order
    folder = "folder"  # a local folder, read as datasets reads a Hub dataset repository
    hub = "hub"  # a Hub dataset id (offline: from the local caches)


@dataclass(frozen=True)
class Source:
    """A resolved ``data.path``: what kind of source it is and, for files, which files in which order."""

    path: str  # as the user typed it
    kind: SourceKind
    files: tuple[str, ...] = ()  # file and glob only
    revision: str | None = None  # Hub ids only: the revision after "@" in the path

    @property
    def repo_id(self) -> str:
        """A Hub id without its ``@revision``."""
        return self.path.split("@", 1)[0]

    @property
    def has_splits(self) -> bool:
        """Folders and Hub datasets have named splits and configs; files are read whole as 'train'."""
        return self.kind in (SourceKind.folder, SourceKind.hub)

    @property
    def builder(self) -> str:
        """The datasets builder that reads the files (json, parquet or csv)."""
        return FORMATS[Path(self.files[0]).suffix.lower()]


def resolve_source(path: str, key: str) -> Source:
    """Classify ``path``: an existing file or folder, a glob (``*``, ``?``, ``[``), else a Hub dataset id
    (``owner/name``, or ``owner/name@revision`` pinned to a branch, tag or commit).

    Args:
        path: the value of ``key``; ``~`` is expanded, relative paths start from the working directory.
        key: the config key that holds it (``data.path`` or ``data.eval_path``), for errors.

    Raises:
        ValueError: a file of an unsupported type, a glob that matches nothing or files of several
            types, or a path that looks local (starts with ``.``, ``/`` or ``~``, has more than one
            ``/`` or a data-file ending) but does not exist. Each names ``key`` and the fix.
    """
    local = os.path.expanduser(path)
    if any(char in path for char in "*?[") and not os.path.exists(local):  # rows[v2].jsonl may be a file
        return _resolve_glob(path, key)
    if os.path.isfile(local):
        _check_type(key, path, Path(path).suffix.lower())
        return Source(path, SourceKind.file, (local,))
    if os.path.isdir(local):
        return Source(path, SourceKind.folder)
    hub = HUB_ID.fullmatch(path)
    if path.startswith((".", "/", "~")) or Path(path).suffix.lower() in DATA_SUFFIXES or hub is None:
        raise ValueError(
            f"{key}={path}: no such file. Point {key} at a .json, .jsonl or .parquet file (or .csv), a folder, "
            "a glob such as data/*.jsonl, or a Hub dataset id such as tatsu-lab/alpaca (tatsu-lab/alpaca@<revision> "
            "for a branch, tag or commit)."
        )
    return Source(path, SourceKind.hub, revision=hub["revision"])


def _check_type(key: str, value: str, suffix: str) -> None:
    if suffix not in FORMATS:
        raise ValueError(f"{key}={value}: unsupported file type '{suffix}'; use {SUPPORTED}.")


def _resolve_glob(pattern: str, key: str) -> Source:
    files = sorted(f for f in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(f))
    if not files:
        raise ValueError(
            f"{key}={pattern}: the pattern matches no files (relative patterns start from {os.getcwd()}). "
            f"Fix the pattern, e.g. {key}=data/*.jsonl."
        )
    suffixes = sorted({Path(f).suffix.lower() for f in files})
    if len(suffixes) > 1:
        raise ValueError(
            f"{key}={pattern}: the pattern matches files of several types ({', '.join(suffixes)}), and they are "
            f"read as one table of one type: narrow it, e.g. {key}=<folder>/*{suffixes[-1]}."
        )
    _check_type(key, pattern, suffixes[0])
    return Source(pattern, SourceKind.glob, tuple(files))


def source_group(key: str) -> str:
    """Where a source's keys live: ``data`` for data.path / data.eval_path, ``data.sources[k]`` in a mixture."""
    return key.removesuffix(".path") if key.startswith("data.sources[") else "data"


def locate_row(source: str, index: int) -> str:
    """``file:line`` of row ``index`` when ``source`` is .jsonl files (one file or a glob, read in order;
    blank lines are not rows), else ``source, row N`` (other file types, folders, Hub ids)."""
    try:
        files = resolve_source(source, "data.path").files
    except ValueError:  # gone since it was read: the row number still says which row
        files = ()
    if files and all(f.lower().endswith(".jsonl") for f in files):
        line = next(itertools.islice(_jsonl_row_lines(files), index, None), None)
        if line is not None:
            return line
    return f"{source}, row {index + 1}"


def _jsonl_row_lines(files: Sequence[str]) -> Iterator[str]:
    """``file:line`` of every row of .jsonl files, in order."""
    for file in files:
        with open(file, encoding="utf-8") as f:
            yield from (f"{file}:{line_no}" for line_no, line in enumerate(f, start=1) if line.strip())
