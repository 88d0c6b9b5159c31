"""Atomic writes: every file or folder exitspec keeps (caches, drafters, tables, checkpoints, shards) is built
under a hidden temporary name beside its place and renamed into it, so that a reader never sees half of it and a
process killed while writing leaves nothing in its place."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """A temporary sibling of `path` for the block to write, renamed over `path` (readable by all: 0644) when the
    block ends without error, removed when it raises. Of two writers at once, the last one's file stays."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.chmod(tmp, 0o644)  # safetensors writes 0600
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: str | Path, text: str) -> None:
    """Writes `text` to `path` through atomic_file, on disk (fsync) before the rename."""
    with atomic_file(path) as tmp, tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


@contextmanager
def atomic_folder(folder: str | Path, replace: bool = True) -> Iterator[Path]:
    """A temporary sibling folder (0755) for the block to fill, moved into `folder`'s place when the block ends
    without error (replace_folder), removed when it raises. replace=False keeps a `folder` that is already there
    and discards the new copy: of two processes building the same cache folder, the first one's stays."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private
        yield tmp
        if replace:
            replace_folder(tmp, folder)
        else:
            try:
                tmp.rename(folder)
            except OSError:  # a folder already there (rename refuses to replace one that holds files)
                if not folder.exists():
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_folder(tmp: Path, folder: Path) -> None:
    """Renames the finished folder `tmp` to `folder`; an existing `folder` is first renamed aside and removed
    after, so that `folder` is whole or (between two renames) missing, never half written."""
    if not folder.exists():
        tmp.rename(folder)
        return
    old = tmp.with_name(tmp.name + "-old")
    folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old)
