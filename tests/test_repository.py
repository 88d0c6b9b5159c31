"""The repository stays light: weights ship only in exitspec/assets, no tracked file elsewhere is over 20 MB, the
wheel is at most 25 MB, and data/ at most 8 MB, holding only what something names."""

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 20 * 2**20
WHEEL_LIMIT = 25 * 2**20
DATA_LIMIT = 8 * 2**20


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


def shipped_files() -> list[Path]:
    """The files a commit of this working tree holds: tracked ones still present, and new ones git does not ignore."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return sorted({ROOT / name for name in out.decode().split("\0") if name and (ROOT / name).is_file()})


def data_files() -> list[str]:
    return [p.relative_to(ROOT).as_posix() for p in shipped_files() if p.relative_to(ROOT).parts[0] == "data"]


def test_the_wheel_is_at_most_25_mb(tmp_path):
    """The wheel ships what a user runs (the code, the default drafter and its lookup table): built from a copy of
    the package, so that no stale build/ folder of the checkout leaks into it."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "exitspec", src / "exitspec", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "wheel"), str(src)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "wheel").glob("exitspec-*.whl")
    assert wheel.stat().st_size <= WHEEL_LIMIT, f"the wheel is {wheel.stat().st_size / 2**20:.1f} MB"
    with zipfile.ZipFile(wheel) as z:
        assets = {PurePosixPath(n).parts[2] for n in z.namelist() if n.startswith("exitspec/assets/")}
    assert assets == {"dflash-smollm2-135m-instruct", "lookup-smollm2-135m-instruct"}


def test_data_is_at_most_8_mb():
    size = sum((ROOT / name).stat().st_size for name in data_files())
    assert size <= DATA_LIMIT, f"data/ holds {size / 2**20:.1f} MB; records nothing reads go (git history keeps them)"


def references() -> set[str]:
    """Every data/ path named by the code, tests, scripts, docs and the drafters' READMEs; a folder's README.md
    named stands for its folder (the record it describes)."""
    sources = ("exitspec", "tests", "scripts", "docs", ".ci")
    texts = [p for p in shipped_files() if p.relative_to(ROOT).parts[0] in sources
             and p.suffix in (".py", ".sh", ".md", "")]
    named = set()
    for path in [*texts, ROOT / "README.md"]:
        for match in re.findall(r"(?<![\w/.])(?:\.\./)*(data/[\w.\-/]+)", path.read_text(errors="replace")):
            named.add(match.rstrip("/.").removesuffix("/README.md"))
    return named


def test_every_file_under_data_is_referenced():
    """A record stays only while code, a test, a script or a doc names it (its path, a folder above it, or its
    folder's README); git history keeps the rest."""
    named = references()
    orphans = [f for f in data_files() if not any(f == n or f.startswith(n + "/") for n in named)]
    assert not orphans, f"files under data/ that nothing references: {orphans}"


def test_the_docs_links_and_data_paths_exist():
    """README.md's and docs/*.md's relative links, and every data/ path they name, point to something that exists."""
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", text):
            if "://" not in target and not target.startswith("mailto:") and not (doc.parent / target).exists():
                missing.append(f"{doc.name}: {target}")
        for path in re.findall(r"(?<![\w/.])(data/[\w.\-/]+)", text):
            if not (ROOT / path.rstrip(".")).exists():
                missing.append(f"{doc.name}: {path}")
    assert not missing, missing


def test_the_readme_results_table_is_made_from_its_record():
    """No number in the README's results table is typed by hand: `python -m exitspec.bench.readme` makes it from
    the committed record, and this fails when the two differ."""
    from exitspec.bench.readme import readme_block, results_table

    assert readme_block((ROOT / "README.md").read_text()) == results_table(ROOT)


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
