"""The README's "Two commands on a fresh machine", their parts after ``pip install`` run as written: ``asyncllm
generate "def fibonacci(n):"`` streams a completion of the bundled tiny model after the echoed prompt; ``pytest`` is
what CI runs (``.ci/run``), with the configuration the README describes (two processes, a file at a time), and
the ``[test]`` extra it installs holds the plugins that configuration needs. docs/quickstart.md's commands are the
same ones."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bash_blocks(doc: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", (ROOT / doc).read_text(), re.M | re.S)


def _readme_commands() -> list[tuple[str, str]]:
    """Each of the README's bash commands as (its pip install, the command after ``&&``)."""
    commands = [block.strip() for block in _bash_blocks("README.md")]
    assert len(commands) == 2, commands
    return [tuple(part.strip() for part in command.split(" && ", 1)) for command in commands]


def test_the_readmes_generate_command_streams_from_the_bundled_model() -> None:
    (install, run), _ = _readme_commands()
    assert install.startswith("pip install torch==") and install.endswith(" .")
    words = shlex.split(run)
    assert words[0] == "asyncllm" and words[1] == "generate", words
    assert _bash_blocks("docs/quickstart.md")[1].strip() == run
    # `python -m asyncllm` is the same command (docs/cli.md), without relying on the console script's PATH
    done = subprocess.run([sys.executable, "-m", "asyncllm", *words[1:]], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-1500:]
    assert done.stdout.startswith(words[-1]) and len(done.stdout) > len(words[-1]), done.stdout
    assert "no --model given: the bundled tiny model" in done.stderr
    assert re.search(r"finish_reason=(length|stop)", done.stderr), done.stderr[-1500:]


def test_the_readmes_test_command_is_cis_and_runs_two_processes_a_file_at_a_time() -> None:
    (generate_install, _), (install, run) = _readme_commands()
    assert run == "pytest"
    ci = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == [f"{install} && {run}"], ci  # "what CI runs, `.ci/run`"
    pin = re.match(r"pip install (torch==\S+) ", generate_install).group(1)
    assert install.startswith(f"pip install {pin} -e \".[test]\""), install  # one pinned torch for both commands
    assert f"pip install {pin} ." in _bash_blocks("docs/quickstart.md")[0]
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (the README says 3.10+)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pytest_options = project["tool"]["pytest"]["ini_options"]
    assert shlex.split(pytest_options["addopts"]) == ["-n", "2", "--dist", "loadfile"]
    assert pytest_options["testpaths"] == ["tests"]
    test_extra = {re.split(r"[<>=\[ ]", requirement)[0] for requirement in
                  project["project"]["optional-dependencies"]["test"]}
    assert {"pytest", "pytest-xdist", "pytest-asyncio", "hypothesis"} <= test_extra, test_extra
    assert project["project"]["requires-python"] == ">=3.10"  # "Python 3.10+"
    assert re.search(r"\(Python 3\.10\+, CPU is enough\)", (ROOT / "README.md").read_text())
