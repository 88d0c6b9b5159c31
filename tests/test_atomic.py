"""Atomic writes: a finished file or folder replaces the old one whole; a write that fails leaves the old one
and no temporary behind."""

import pytest

from exitspec.atomic import atomic_file, atomic_folder, write_atomic


def test_a_file_is_replaced_whole_or_not_at_all(tmp_path):
    path = tmp_path / "sub" / "state.json"
    write_atomic(path, "old")
    with pytest.raises(RuntimeError), atomic_file(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed while writing")
    assert path.read_text() == "old" and sorted(p.name for p in path.parent.iterdir()) == ["state.json"]
    write_atomic(path, "new")
    assert path.read_text() == "new" and path.stat().st_mode & 0o777 == 0o644


def test_a_folder_is_replaced_or_kept_whole(tmp_path):
    folder = tmp_path / "model"
    for text in ("old", "new"):
        with atomic_folder(folder) as tmp:
            (tmp / "config.json").write_text(text)
    assert (folder / "config.json").read_text() == "new" and folder.stat().st_mode & 0o777 == 0o755
    with atomic_folder(folder, replace=False) as tmp:  # a cache folder built twice: the first one stays
        (tmp / "config.json").write_text("second")
    with pytest.raises(RuntimeError), atomic_folder(folder) as tmp:
        (tmp / "config.json").write_text("half")
        raise RuntimeError("killed while writing")
    assert (folder / "config.json").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["model"]
