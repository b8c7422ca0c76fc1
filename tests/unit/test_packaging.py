"""The wheel holds every package folder under asyncllm.* and nothing at a generic top level; a source checkout's
./asyncllm finds the subpackages pyproject maps from top-level folders (workers/, kernels/, integrations/)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_contains_every_package(tmp_path: pathlib.Path) -> None:
    build = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
        check=True, capture_output=True, text=True,
    )
    assert "absent from the `packages` configuration" not in build.stdout + build.stderr  # a data folder unlisted
    (wheel,) = tmp_path.glob("asyncllm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_levels = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_levels == {"asyncllm"}
    expected = {"asyncllm/__init__.py", "asyncllm/py.typed"}
    for folder in [p for p in (ROOT / "asyncllm").rglob("__init__.py")]:
        expected.add(str(folder.relative_to(ROOT)))
    for src, dest in (("kernels", "kernels"), ("workers", "workers"), ("integrations", "integrations")):
        for py in (ROOT / src).rglob("*.py"):
            expected.add(f"asyncllm/{dest}/{py.relative_to(ROOT / src)}")
    for py in (ROOT / "asyncllm").rglob("*.py"):
        expected.add(str(py.relative_to(ROOT)))
    for data in [*(ROOT / "asyncllm" / "data" / "tiny-llama").iterdir(), *(ROOT / "asyncllm" / "bench" / "presets").iterdir()]:
        expected.add(str(data.relative_to(ROOT)))  # package data: the bundled model, the bench's presets
    missing = sorted(expected - set(names))
    assert not missing, f"missing from the wheel: {missing}"


def test_checkout_root_finds_the_mapped_subpackages(tmp_path: pathlib.Path) -> None:
    """A script run from the root of a checkout imports its ./asyncllm, which shadows the installed package (or an
    editable install's mapping): asyncllm.workers, .kernels and .integrations come from the checkout's folders, and
    only those (no asyncllm.tests, nor asyncllm.asyncllm: a second copy of the package)."""
    for folder in ("asyncllm", "workers", "kernels", "integrations"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__", "data"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    code = ("import importlib.util, asyncllm.integrations.sync as sync\n"
            "print(importlib.util.find_spec('asyncllm.workers.worker').origin)\n"
            "print(importlib.util.find_spec('asyncllm.kernels').origin)\nprint(sync.__file__)\n"
            "assert [importlib.util.find_spec(f'asyncllm.{n}') for n in ('tests', 'docs', 'asyncllm')] == [None] * 3")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(tmp_path / "workers" / "worker.py"), str(tmp_path / "kernels" / "__init__.py"),
                                  str(tmp_path / "integrations" / "sync.py")]


@pytest.mark.slow
def test_sdist_carries_the_docs_and_tests(tmp_path: pathlib.Path) -> None:
    """Error messages name docs/ pages (docs/integrations/task-runners.md, ...): the sdist holds them, the tests and
    the examples beside the sources."""
    import tarfile

    source = tmp_path / "src"  # a copy without this checkout's egg-info, whose SOURCES.txt an sdist would reuse
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "*.egg-info", "build", "dist", "__pycache__"))
    subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(tmp_path), str(source)],
                   check=True, capture_output=True, text=True)
    (sdist,) = tmp_path.glob("asyncllm-*.tar.gz")
    names = {name.split("/", 1)[1] for name in tarfile.open(sdist).getnames() if "/" in name}
    for folder in ("docs", "tests", "examples"):
        expected = {str(p.relative_to(ROOT)) for p in (ROOT / folder).rglob("*")
                    if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
        missing = sorted(expected - names)
        assert not missing, f"missing from the sdist: {missing[:10]}"


def test_the_checkout_root_leaves_the_name_kernels_to_the_installed_distribution() -> None:
    """Run from the checkout's root (``python -c``: the root first on sys.path), ``import kernels`` is Hugging Face's
    installed ``kernels`` where there is one (transformers 5.25 imports it with every model), else this folder;
    ``asyncllm.kernels`` is ours either way."""
    import importlib.machinery

    installed = importlib.machinery.PathFinder.find_spec("kernels", [p for p in sys.path if p and p != str(ROOT)])
    code = "import kernels, asyncllm.kernels as ours; print(kernels.__file__); print(ours.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    top, ours = out.stdout.split()
    assert pathlib.Path(ours) == ROOT / "kernels" / "__init__.py"
    expected = pathlib.Path(installed.origin) if installed is not None else ROOT / "kernels" / "__init__.py"
    assert pathlib.Path(top) == expected
