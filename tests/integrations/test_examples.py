"""The examples stay valid: every file compiles, the app modules build their apps (nothing starts), and the first
scripts a reader runs (quickstart, generate_many, sync_script) run on the bundled model."""

from __future__ import annotations

import importlib.util
import py_compile
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("path", sorted(EXAMPLES.rglob("*.py")), ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_example_compiles(path: Path) -> None:
    py_compile.compile(str(path), doraise=True)


@pytest.mark.parametrize("name", ["starlette_app", "aiohttp_app", "shared_engine/app"])
def test_example_app_builds(name: str) -> None:
    spec = importlib.util.spec_from_file_location(name.replace("/", "_"), EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # constructing an engine is cheap: nothing starts before a request
    assert module.app is not None


@pytest.mark.parametrize("name", ["quickstart", "generate_many", "sync_script"])
def test_example_script_runs_on_the_bundled_model(name: str) -> None:
    """The scripts a reader runs first work as written (the bundled tiny model, no download): exit 0, output printed,
    no traceback."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py")], capture_output=True, text=True,
                          timeout=300, cwd=EXAMPLES.parent)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stdout.strip(), done.stderr[-2000:]
