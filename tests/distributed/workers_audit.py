"""Workers that let the test see every file a non-zero rank creates or changes in the run folder.

A Python audit hook misses most writes: ``torch.save`` writes from C++, safetensors from Rust.
So every rank but 0 trains in a private view of the run folder instead: its own mount
namespace, with an overlay mounted over the run folder (lower layer: the real folder; upper
layer: a scratch folder beside it). Whatever such a rank, its threads or its child processes
create, change, rename or delete there, by any API, lands in the upper layer and never reaches
the real folder, while everything rank 0 writes stays visible to it. The test reads the upper
layer after the run: empty means the rank wrote nothing.

Needs CAP_SYS_ADMIN (root in a container) or unprivileged user namespaces (Linux 5.11+).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
REPO = Path(__file__).resolve().parent.parent.parent


def upper_dir(run_dir: str | Path, rank: int) -> Path:
    """The folder that collects rank ``rank``'s changes to ``run_dir`` (outside it: layers must not overlap)."""
    run_dir = Path(run_dir)
    return run_dir.parent / f"{run_dir.name}.rank{rank}-changes"


def changes_by_rank(run_dir: str | Path, rank: int) -> list[str]:
    """Every path under ``run_dir`` that rank ``rank`` created, changed or deleted, relative to ``run_dir``.

    Folders appear only when nothing below them did (a folder made or touched, nothing written in it);
    a deletion appears as ``deleted <path>`` (overlayfs records it as a 0:0 character device).

    Raises:
        FileNotFoundError: the rank never mounted its view (nothing could have been recorded).
    """
    upper = upper_dir(run_dir, rank) / "upper"
    if not upper.is_dir():
        raise FileNotFoundError(f"{upper}: rank {rank} never mounted its private view of {run_dir}")
    found = []
    for path in sorted(upper.rglob("*")):
        if path.is_dir() and not path.is_symlink() and any(path.iterdir()):
            continue
        relative = str(path.relative_to(upper))
        is_whiteout = path.is_char_device() and os.stat(path, follow_symlinks=False).st_rdev == 0
        found.append(f"deleted {relative}" if is_whiteout else relative)
    return found


def _libc_call(name: str, *args) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{name}{args}: {os.strerror(code)}")


def _enter_private_mount_namespace() -> None:
    """Move this process into a mount namespace of its own (a user namespace too when not root)."""
    # unshare(CLONE_NEWNS) moves only the calling thread: a thread started earlier would keep
    # writing through the real folder. Threads and processes started later inherit the namespace.
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:
        raise RuntimeError(f"the private view needs a single-threaded process; this one has {len(threads)} threads")
    try:
        _libc_call("unshare", CLONE_NEWNS)
    except OSError as err:
        if err.errno != errno.EPERM or os.geteuid() == 0:
            raise
        uid, gid = os.geteuid(), os.getegid()  # not root: a user namespace in which this user is root
        _libc_call("unshare", CLONE_NEWUSER | CLONE_NEWNS)
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"0 {uid} 1")
        Path("/proc/self/gid_map").write_text(f"0 {gid} 1")
    # Private propagation: the overlay must not show up in the parent's namespace (rank 0's view).
    _libc_call("mount", b"none", b"/", None, MS_REC | MS_PRIVATE, None)


def mount_private_view(folder: Path, scratch: Path) -> None:
    """Overlay ``folder`` for this process only; its changes go to ``scratch/upper``.

    Raises:
        OSError: no mount namespace or no overlayfs here (names the failing call).
        RuntimeError: the process already runs threads, or the overlay is not in place afterwards.
    """
    folder, scratch = folder.resolve(), scratch.resolve()
    upper, work = scratch / "upper", scratch / "work"
    upper.mkdir(parents=True)
    work.mkdir()
    for path in (folder, upper, work):
        if any(c in str(path) for c in ",:\\"):
            raise RuntimeError(f"{path}: overlayfs options cannot hold ',', ':' or '\\'")
    _enter_private_mount_namespace()
    options = f"lowerdir={folder},upperdir={upper},workdir={work}"
    try:  # redirect_dir: the rank may rename folders rank 0 made (recorded in upper); without it that fails
        _libc_call("mount", b"overlay", str(folder).encode(), b"overlay", 0, f"{options},redirect_dir=on".encode())
    except OSError:  # not offered here (inside a user namespace: EPERM)
        _libc_call("mount", b"overlay", str(folder).encode(), b"overlay", 0, options.encode())
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    if not any(line.split()[4] == str(folder) and " - overlay " in line for line in mounts):
        raise RuntimeError(f"no overlay on {folder} after mounting it")


# What rank 1 had changed in the run folder when training ended, before it misbehaves (outside the run folder).
CHANGES_AFTER_TRAINING = "changes-after-training.json"


def train_then_write_as_rank1(cfg, run_dir: str, store_port: int | None) -> None:
    """The real worker; every rank but 0 sees the run folder through its own overlay. When training is over, rank 1
    records what it had changed so far, then misbehaves: it writes into the run folder with torch.save (C++) and
    safetensors (Rust), which the check must catch. One run for both checks: nothing rank 1 does after the real
    worker returned can hide what it did before."""
    rank = int(os.environ["RANK"])  # set by the launcher: known before the process group forms
    if rank != 0:  # before anything in this process touches the run folder
        mount_private_view(Path(run_dir), upper_dir(run_dir, rank))
    from ddptrain.launch import worker

    worker(cfg, run_dir, store_port)  # the real body of every rank
    if rank != 1:
        return
    import torch
    from safetensors.torch import save_file

    (upper_dir(run_dir, rank) / CHANGES_AFTER_TRAINING).write_text(json.dumps(changes_by_rank(run_dir, rank)))
    torch.save({"w": torch.ones(2)}, Path(run_dir) / "rank1.pt")  # a new file
    save_file({"w": torch.ones(2)}, str(Path(run_dir) / "adapter" / "adapter_model.safetensors"))  # rank 0's


def changes_after_training(run_dir: str | Path, rank: int) -> list[str]:
    """``changes_by_rank`` as rank ``rank`` recorded it when the real worker returned (train_then_write_as_rank1)."""
    return json.loads((upper_dir(run_dir, rank) / CHANGES_AFTER_TRAINING).read_text())


def _probe(scratch: Path) -> None:
    """Mount a private view over a fresh folder and check that a write lands in the upper layer only."""
    folder = scratch / "folder"
    folder.mkdir(parents=True)
    mount_private_view(folder, scratch / "changes")
    (folder / "probe").write_text("x")
    if not (scratch / "changes" / "upper" / "probe").is_file():
        raise RuntimeError("a write through the overlay did not land in its upper layer")


def private_view_unavailable(scratch: Path) -> str | None:
    """Why a process here cannot get a private view of a folder (tried in a subprocess); None if it can."""
    code = "import sys, pathlib; from tests.distributed.workers_audit import _probe; _probe(pathlib.Path(sys.argv[1]))"
    result = subprocess.run(
        [sys.executable, "-c", code, str(scratch)], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    if result.returncode == 0:
        return None
    return (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1]
