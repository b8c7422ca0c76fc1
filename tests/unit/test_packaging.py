"""The wheel holds every package folder under asyncllm.* and nothing at a generic top level."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_contains_every_package(tmp_path: pathlib.Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
        check=True, capture_output=True,
    )
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
    for data in (ROOT / "asyncllm" / "data" / "tiny-llama").iterdir():  # the bundled model (package data)
        expected.add(str(data.relative_to(ROOT)))
    missing = sorted(expected - set(names))
    assert not missing, f"missing from the wheel: {missing}"
