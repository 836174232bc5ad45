"""The ``data`` group's schema (``conf/data/``): where rows come from (one path or a mixture of ``data.sources``),
their template and field names, lengths and batching, and their checks. The data side (``ddptrain.data``) reads these
keys; the checks use only its standard-library parts (``sources``, ``batch_cost``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from omegaconf import MISSING

from ddptrain.config.checks import _positive
from ddptrain.data.batch_cost import cost_rule
from ddptrain.data.sources import Source, SourceKind, resolve_source


class Template(str, Enum):
    alpaca = "alpaca"  # instruction / input / output rows
    chat = "chat"  # rows with a list of {"role", "content"} messages (OpenAI style)
    sharegpt = "sharegpt"  # rows with a list of {"from": human|gpt|system, "value"} turns
    text = "text"  # plain text: loss on every token (continued pre-training)
    preference = "preference"  # prompt, chosen and rejected replies (objective=dpo)


class Batching(str, Enum):
    random = "random"  # shuffled, fixed rows per micro-batch
    length_grouped = "length_grouped"  # similar lengths share a micro-step
    token_budget = "token_budget"  # rows x padded length <= data.max_tokens_per_batch
    packed = "packed"  # samples concatenated without padding


@dataclass
class SourceConfig:
    """One dataset of a mixture (``data.sources``); a key left null takes the value of data.<key>."""

    path: str = MISSING
    """A file, a glob, a folder or a Hub dataset id, as data.path takes."""
    weight: Optional[float] = None
    """Share of the mixture (weights are normalised); a source short of rows is repeated to reach it."""
    max_rows: Optional[int] = None
    """Read at most the first N rows of this source."""
    subset: Optional[str] = None
    split: Optional[str] = None
    revision: Optional[str] = None
    """A Hub id's branch, tag or commit (or path: owner/name@revision); null = its default branch."""
    template: Optional[Template] = None
    eval_fraction: Optional[float] = None
    """Share of this source held out for evaluation (the eval split is taken per source)."""
    eval_split: Optional[str] = None
    """This source's own split (a folder or Hub id) as its eval rows, instead of eval_fraction."""
    instruction_field: Optional[str] = None
    input_field: Optional[str] = None
    output_field: Optional[str] = None
    messages_field: Optional[str] = None
    conversations_field: Optional[str] = None
    role_field: Optional[str] = None
    content_field: Optional[str] = None
    text_field: Optional[str] = None
    prompt_field: Optional[str] = None
    chosen_field: Optional[str] = None
    rejected_field: Optional[str] = None


@dataclass
class DataConfig:
    path: Optional[str] = MISSING
    """Training rows, read through datasets: a .json, .jsonl, .parquet or .csv file; a glob of such files
    (data/*.jsonl: one type, sorted order); a local folder (read as a Hub dataset repository is: its
    README's configs, files named by split, or every data file as 'train'); or a Hub dataset id
    (tatsu-lab/alpaca). A path that starts with ., / or ~, or ends in a data-file type, must exist
    locally; anything else is a Hub id. HF_HUB_OFFLINE=1 / HF_DATASETS_OFFLINE=1 are honoured: a Hub id is
    then read from the local caches (hf download --repo-type dataset <id> fills them). null with data.sources."""
    subset: Optional[str] = None
    """Config (subset) of a folder or Hub dataset, datasets' load_dataset(name=...); null = its default.
    Files and globs have none: it must stay null unless data.path or data.eval_path is a folder or Hub id."""
    split: str = "train"
    """Split of a folder or Hub dataset (data.path and data.eval_path alike). A file or glob is read whole,
    as datasets' 'train' split: any other value is refused unless data.path or data.eval_path is a folder
    or Hub id."""
    revision: Optional[str] = None
    """Branch, tag or commit of the Hub dataset data.path (owner/name@revision in data.path says the same);
    null = its default branch. Offline, that revision must be in the Hub cache (hf download --revision)."""
    eval_path: Optional[str] = None
    """Held-out rows, in any form data.path takes (a folder or Hub id read with data.subset and
    data.eval_split, else data.split); null = the eval rows come from data.path."""
    eval_split: Optional[str] = None
    """The split read as the eval set: of data.eval_path when it is set, else data.path's own (a folder or Hub id,
    e.g. data.eval_split=test, at data.revision). Takes precedence over data.eval_fraction."""
    eval_fraction: float = 0.0
    """Share of data.path held out for evaluation when data.eval_path and data.eval_split are null."""
    template: Template = Template.alpaca
    instruction_field: str = "instruction"
    input_field: str = "input"
    """Optional field: rows without it, or with it empty, use the no-input prompt."""
    output_field: str = "output"
    messages_field: str = "messages"
    """template=chat: the field holding the list of {"role", "content"} messages."""
    conversations_field: str = "conversations"
    """template=sharegpt: the field holding the list of turns."""
    role_field: str = "from"
    """template=sharegpt: the key of a turn's speaker (human, gpt, system; user and assistant also work)."""
    content_field: str = "value"
    """template=sharegpt: the key of a turn's text."""
    text_field: str = "text"
    """template=text: the field holding the text (every token is trained on, EOS appended)."""
    prompt_field: str = "prompt"
    """template=preference: the prompt, a text or a list of messages (absent: the conversations' shared start)."""
    chosen_field: str = "chosen"
    """template=preference: the preferred reply: a text, an assistant message, or the whole conversation."""
    rejected_field: str = "rejected"
    """template=preference: the other reply, in the same form as the chosen one."""
    chat_template: Optional[str] = None
    """chat and sharegpt rows: null = the tokenizer's own chat template (ChatML when it has none);
    a Jinja string or a path to a .jinja file; chatml = ChatML whatever the tokenizer has."""
    max_length: int = 1024
    """Longer rows are truncated (counted and reported)."""
    max_rows: Optional[int] = None
    """Use only the first N rows of data.path (quick runs); null = all."""
    micro_batch_size: int = 8
    """Rows per rank per forward pass (random and length_grouped batching)."""
    batching: Batching = Batching.length_grouped
    max_tokens_per_batch: int = 8192
    """token_budget / packed: padded tokens per rank per forward pass never exceed this."""
    pad_to_multiple_of: int = 1
    """Round padded lengths up to a multiple of this (e.g. 8 for tensor-core shapes); costs ~3% padding on Alpaca."""
    costliest_first: bool = True
    """Put the micro-step with the most padded tokens first, so an OOM shows at step 1."""
    skip_bad_rows: bool = False
    """false: a malformed row is an error naming file and line; true: skip it and log a count."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0 = collate in the training process)."""
    cache_dir: Optional[str] = None
    """datasets cache for tokenized data; null = the datasets default (~/.cache/huggingface)."""
    prepare_timeout_s: int = 3600
    """How long other ranks wait while local rank 0 tokenizes the dataset."""
    num_proc: Optional[int] = None
    """Processes that tokenize a large file (datasets' map workers, on local rank 0 only); null = 1."""
    sources: list[SourceConfig] = field(default_factory=list)
    """A mixture instead of data.path: several datasets, each with its own path, template and field
    names (unset ones come from data.*) and either a weight (its share of the mixture) or max_rows."""


def _check_data(d: DataConfig) -> list[str]:
    problems = _positive(
        {
            "data.max_length": d.max_length,
            "data.micro_batch_size": d.micro_batch_size,
            "data.max_tokens_per_batch": d.max_tokens_per_batch,
            "data.pad_to_multiple_of": d.pad_to_multiple_of,
            "data.max_rows": d.max_rows,
            "data.num_proc": d.num_proc,
        }
    )
    if not 0.0 <= d.eval_fraction < 1.0:
        problems.append(f"data.eval_fraction={d.eval_fraction} must be in [0, 1).")
    longest_row = cost_rule(d.batching == Batching.packed, max(d.pad_to_multiple_of, 1))([d.max_length])
    if d.batching in (Batching.token_budget, Batching.packed) and d.max_tokens_per_batch < longest_row:
        problems.append(
            f"data.max_tokens_per_batch={d.max_tokens_per_batch} is below data.max_length={d.max_length} "
            f"({longest_row} tokens as a micro-batch): one full-length row would not fit; raise "
            "data.max_tokens_per_batch or lower data.max_length."
        )
    problems += _check_paths(d)
    if d.num_workers < 0:
        problems.append(f"data.num_workers={d.num_workers} must be 0 or more.")
    return problems


def _check_chat_template(d: DataConfig) -> list[str]:
    """data.chat_template: chatml, a Jinja template (it has {{ or {%), or a file that exists."""
    value = d.chat_template
    if value is None or value == "chatml" or is_jinja(value) or os.path.isfile(os.path.expanduser(value)):
        return []
    return [
        f"data.chat_template={value}: no such file, and not a Jinja template (no {{{{ or {{%). Point it at a "
        ".jinja file, give the template itself, or use data.chat_template=chatml (or null: the tokenizer's own)."
    ]


def _check_sources(d: DataConfig) -> list[str]:
    """data.sources: instead of data.path, weights on all sources or none."""
    if not d.sources:
        return [] if d.path is not None else ["data.path is required: data.path=<file, glob, folder or hub id>."]
    problems = []
    if d.path is not None:
        problems.append(
            f"data.sources and data.path={d.path} are both set: a mixture reads only data.sources. Set "
            "data.path=null (data=mixture does), or drop data.sources."
        )
    if d.max_rows is not None:
        problems.append(
            f"data.max_rows={d.max_rows} applies to data.path, not to a mixture: set data.sources[k].max_rows on "
            "the sources to cut, and data.max_rows=null."
        )
    mixture_only = (
        ("data.split", d.split, "train"),
        ("data.subset", d.subset, None),
        ("data.revision", d.revision, None),
    )
    for key, value, default in (*mixture_only, ("data.eval_split", d.eval_split, None)):
        if value != default and (key != "data.eval_split" or d.eval_path is None):
            problems.append(f"{key}={value} applies to data.path, not to a mixture: set data.sources[k].{key[5:]}.")
    weights = [s.weight for s in d.sources]
    if any(w is None for w in weights) and any(w is not None for w in weights):
        problems.append(
            f"data.sources: weights {weights} are set on some sources only: give every source a weight (its share "
            "of the mixture), or none (every row of every source, once)."
        )
    return problems + [problem for k, source in enumerate(d.sources) for problem in _check_source(k, source)]


def _check_source(k: int, source: SourceConfig) -> list[str]:
    """One entry of data.sources: a path that can be read, settings in range, split/subset only where they act."""
    key = f"data.sources[{k}]"
    problems = _positive({f"{key}.max_rows": source.max_rows})
    if source.weight is not None and source.weight <= 0:
        problems.append(f"{key}.weight={source.weight} must be positive.")
    if source.eval_fraction is not None and not 0.0 <= source.eval_fraction < 1.0:
        problems.append(f"{key}.eval_fraction={source.eval_fraction} must be in [0, 1).")
    try:
        resolved = resolve_source(source.path, f"{key}.path")
    except ValueError as err:
        return [*problems, str(err)]
    if not resolved.has_splits and (source.split not in (None, "train") or source.subset is not None):
        problems.append(
            f"{key} sets split={source.split} / subset={source.subset}, which have no effect: "
            f"{source.path} names files, read whole. Remove them, or point the source at a folder or Hub dataset."
        )
    problems += _check_revision(f"{key}.revision", source.revision, f"{key}.path", resolved)
    if source.eval_split is not None and not resolved.has_splits:
        problems.append(
            f"{key}.eval_split={source.eval_split}: {source.path} names files, which have one split ('train'). "
            f"Hold out a share instead ({key}.eval_fraction), or point the source at a folder or Hub dataset."
        )
    elif source.eval_split is not None and source.eval_split == (source.split or "train"):
        problems.append(_same_split(f"{key}.eval_split", source.eval_split, f"{key}.split"))
    return problems


def _check_revision(key: str, revision: str | None, path_key: str, source: Source) -> list[str]:
    """A revision (key, or @revision in the path) names a Hub dataset's branch, tag or commit, and only one."""
    if revision is not None and source.kind != SourceKind.hub:
        return [
            f"{key}={revision} applies to Hub dataset ids only, and {path_key}={source.path} is a local "
            f"{source.kind.value}: remove {key} (a folder holds one revision; check out the one you want there)."
        ]
    if revision is not None and source.revision not in (None, revision):
        return [f"{path_key}={source.path} pins revision {source.revision}, but {key}={revision}: keep one of them."]
    return []


def _same_split(key: str, value: str, split_key: str) -> str:
    return (
        f"{key}={value} is also the split trained on ({split_key}), so the eval rows would be training rows: "
        f"name another split (e.g. {key}=test), or set {key}=null."
    )


def _check_eval_split(d: DataConfig, sources: dict[str, Source]) -> list[str]:
    """data.eval_split: a split of data.eval_path, else of data.path, which must then be a folder or Hub id."""
    if d.eval_split is None:
        return []
    key = "data.eval_path" if "data.eval_path" in sources else "data.path"
    if not sources[key].has_splits:
        return [
            f"data.eval_split={d.eval_split}: {key}={sources[key].path} names files, which have one split ('train'). "
            "Point data.eval_path at the eval rows, hold out a share (data.eval_fraction), or point data.path at a "
            "folder or Hub dataset that has the split."
        ]
    if key == "data.path" and d.eval_split == d.split:
        return [_same_split("data.eval_split", d.eval_split, "data.split")]
    return []


def is_jinja(text: str) -> bool:
    """Whether a data.chat_template value is a template rather than a file name."""
    return "{{" in text or "{%" in text


def _check_paths(d: DataConfig) -> list[str]:
    """Local paths must exist (Hub ids are checked when loaded); data.subset/split/eval_split need a folder or Hub
    id, data.revision a Hub id."""
    problems, sources = [], {}
    for key, value in (("data.path", d.path), ("data.eval_path", d.eval_path)):
        try:
            sources.update({key: resolve_source(value, key)} if value is not None else {})
        except ValueError as err:
            problems.append(str(err))
    if problems or not sources:
        return problems
    if "data.path" in sources:
        problems += _check_revision("data.revision", d.revision, "data.path", sources["data.path"])
    problems += _check_eval_split(d, sources)
    if any(s.has_splits for s in sources.values()):
        return problems
    names = " and ".join(f"{key}={s.path}" for key, s in sources.items())
    for key, value, default in (("data.split", d.split, "train"), ("data.subset", d.subset, None)):
        if value != default:
            problems.append(
                f"{key}={value} has no effect: {names} names files, which are read whole (as datasets' 'train' "
                f"split). Remove {key}, or point data.path at a folder or Hub dataset that has it."
            )
    return problems
