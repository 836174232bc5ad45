"""Reading a source's rows through ``datasets``: a file, a glob, a folder or a Hub dataset id.

``sources.py`` decides which of these ``data.path`` (or ``data.eval_path``, or ``data.sources[k].path``) is;
``load_rows`` reads it. Offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) a Hub id comes from the local caches.
A source that cannot be read is refused naming the key, the reason and the fix (a bad .jsonl line by file
and line).
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import huggingface_hub

from ddptrain.data.sources import Source, SourceKind, resolve_source, source_group


def load_rows(
    path: str,
    cache_dir: str | None,
    key: str = "data.path",
    subset: str | None = None,
    split: str = "train",
    revision: str | None = None,
    split_key: str | None = None,
) -> datasets.Dataset:
    """Read a file, glob, folder or Hub dataset id (``sources.resolve_source``) through ``datasets``.

    Files and globs are read whole; a folder or Hub id gives its ``split`` of config ``subset``, as
    ``datasets.load_dataset`` reads a Hub repository; a Hub id at ``revision`` (a branch, tag or commit: the
    ``@revision`` in ``path`` or ``data.revision``), else at its default branch. Offline (HF_HUB_OFFLINE /
    HF_DATASETS_OFFLINE), a Hub id is read from the Hub cache (``hf download``) or from datasets' cache of an
    earlier load.

    Args:
        path: the value of ``key`` as the user typed it.
        cache_dir: ``data.cache_dir``; null = the datasets default.
        key: the config key that named the source (``data.path`` or ``data.eval_path``), for errors.
        subset: ``data.subset`` (folders and Hub ids).
        split: ``data.split`` (folders and Hub ids), or ``data.eval_split`` for the eval set.
        revision: ``data.revision`` (Hub ids); null = the one after ``@`` in ``path``, if any.
        split_key: the key that named ``split``, for errors; null = ``data.split`` (or the source's own).

    Returns:
        The rows, cached as Arrow by ``datasets``.

    Raises:
        ValueError: naming ``key`` and the fix: an unsupported file type, a local path or glob that
            matches nothing, a line that is not valid JSON (by file and line), a Hub dataset that cannot
            be found or reached, or a split or subset that the dataset lacks.
    """
    source = resolve_source(path, key)
    revision = revision or source.revision
    offline = _hub_offline()
    datasets.disable_progress_bars()
    try:
        if not source.has_splits:  # data files: datasets names their rows the 'train' split
            files = list(source.files)
            read_as = _csv_as_text(files[0]) if source.builder == "csv" else {}
            return datasets.load_dataset(
                source.builder, data_files=files, split="train", cache_dir=cache_dir, **read_as
            )
        with _offline_mode(offline):
            local = _local_copy(source, revision, offline)
            if offline and revision and local == source.repo_id:
                # datasets' offline fallback would load whichever revision it cached last, not this one
                raise datasets.exceptions.DatasetNotFoundError(f"no snapshot of revision {revision} in the Hub cache")
            at = {"revision": revision} if local == source.repo_id else {}  # a folder or a snapshot is one revision
            return datasets.load_dataset(local, name=subset, split=split, cache_dir=cache_dir, **at)
    except Exception as exc:  # datasets wraps parse errors several layers deep
        where = _Where(key, split_key or f"{source_group(key)}.split", revision)
        raise ValueError(f"{key}={_explain_load_error(source, where, offline, exc)}") from exc


def _hub_offline() -> bool:
    """Whether the Hub is off limits, decided as datasets does (HF_DATASETS_OFFLINE, else HF_HUB_OFFLINE).

    datasets and huggingface_hub read the variables once, at import; reading them again here honours a
    value set later (a notebook, a test's monkeypatch).
    """
    value = os.environ.get("HF_DATASETS_OFFLINE")
    if value is None:
        value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return datasets.config.HF_HUB_OFFLINE or (value or "").upper() in datasets.config.ENV_VARS_TRUE_VALUES


@contextlib.contextmanager
def _offline_mode(offline: bool) -> Iterator[None]:
    """Keep datasets and huggingface_hub off the network for one load when ``offline`` (see _hub_offline)."""
    saved = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    if offline:
        datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved


def _local_copy(source: Source, revision: str | None, offline: bool) -> str:
    """What datasets loads: the folder; offline, a Hub id's snapshot (at ``revision``) in the Hub cache; else the
    id itself (datasets then fetches ``revision``)."""
    if source.kind == SourceKind.folder:
        return os.path.expanduser(source.path)
    if offline:
        # datasets, offline, looks only in its own cache of an earlier load, not in the Hub cache
        # that `hf download` fills; look there first (local_files_only: no network).
        with contextlib.suppress(huggingface_hub.errors.LocalEntryNotFoundError):
            return huggingface_hub.snapshot_download(
                source.repo_id, repo_type="dataset", revision=revision, local_files_only=True
            )
    return source.repo_id


@dataclass(frozen=True)
class _Where:
    """What an error names: the key of the source, the key of the split read, the revision asked for."""

    key: str
    split_key: str
    revision: str | None


def _csv_as_text(first_file: str) -> dict[str, Any]:
    """Read every CSV column as text: pandas would make an answer column of digits integers (a row error),
    infer types chunk by chunk (a column empty for 10k rows, then filled, fails to load) and turn
    empty cells into NaN."""
    with open(first_file, newline="", encoding="utf-8") as f:
        header = next(csv.reader(f), [])
    return {
        "features": datasets.Features({name: datasets.Value("string") for name in header}),
        "keep_default_na": False,
    }


def _explain_load_error(source: Source, where: _Where, offline: bool, exc: Exception) -> str:
    """Why ``source`` could not be read, and the fix: the text after ``<key>=``."""
    path, text, key = source.path, str(exc), where.key
    if source.kind == SourceKind.hub and isinstance(exc, (ConnectionError, datasets.exceptions.DatasetNotFoundError)):
        at = f" at revision {where.revision}" if where.revision else ""
        download = f"{source.repo_id} --revision {where.revision}" if where.revision else source.repo_id
        if offline:
            why = f"offline mode is on (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) and no local cache holds it{at}"
        elif isinstance(exc, ConnectionError):
            why = f"the Hugging Face Hub could not be reached ({text})"
        else:
            why = f"the Hub has no dataset{at} by that name that you can read ({text}); check the id and your login"
        return (
            f"{path}: no such local file or folder, so it was read as a Hub dataset id, but {why}. Run "
            f"`hf download --repo-type dataset {download}` on a machine with network (into the Hub cache this "
            f"machine reads), or download it to a folder (--local-dir) and point {key} at that folder."
        )
    if "Unknown split" in text:
        return f"{path}: {text} Set {where.split_key} to one of them."
    if "BuilderConfig" in text:
        return f"{path}: {text} Set {source_group(key)}.subset to one of them (the dataset's configs)."
    for file in _jsonl_files(source):
        if (bad_line := _first_bad_line(file)) is not None:
            return bad_line if source.kind == SourceKind.file else f"{path}: {bad_line}"
    return (
        f"{path}: could not be read as a dataset: {type(exc).__name__}: {exc}. Data files must be .json lists of "
        "objects, .jsonl files with one object per line, .parquet tables or .csv tables with a header row."
    )


def _jsonl_files(source: Source) -> list[str]:
    """The .jsonl files a source reads (for a folder: every .jsonl file under it), in order."""
    if source.kind == SourceKind.folder:
        return sorted(str(p) for p in Path(source.path).expanduser().rglob("*.jsonl"))
    return [f for f in source.files if f.lower().endswith(".jsonl")]


def _first_bad_line(path: str) -> str | None:
    """``path:line`` and the fix for the first line of a .jsonl file that is not a JSON object."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                return f"{path}:{line_no}: not valid JSON ({err.msg}). Fix or remove that line."
            if not isinstance(row, dict):
                return (
                    f"{path}:{line_no}: each line must be a JSON object, got {type(row).__name__}. "
                    'Write one object per line, e.g. {"instruction": ..., "output": ...}.'
                )
    return None
