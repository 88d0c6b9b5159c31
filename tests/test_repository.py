"""The repository stays light: weights ship only in exitspec/assets, and no tracked file elsewhere is over 20 MB."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 20 * 2**20


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in out.decode().split("\0") if name]


def test_no_large_files_outside_the_assets():
    large = [
        f"{path.relative_to(ROOT)} ({path.stat().st_size / 2**20:.0f} MB)"
        for path in tracked_files()
        if path.is_file() and path.stat().st_size > LIMIT and "exitspec/assets" not in path.relative_to(ROOT).as_posix()
    ]
    assert not large, f"tracked files over 20 MB outside exitspec/assets: {large}"


def test_weights_only_in_the_assets():
    weights = [
        path.relative_to(ROOT).as_posix()
        for path in tracked_files()
        if path.suffix in (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")
    ]
    assert all(w.startswith("exitspec/assets/") for w in weights), weights
