"""``asyncllm serve`` without the server extra (README's bare install): one line naming the extra, no traceback."""

from __future__ import annotations

import subprocess
import sys

SERVE_WITHOUT = ("import sys; sys.modules[{name!r}] = None; sys.argv = ['asyncllm', 'serve']\n"
                 "from asyncllm.cli import main; main()")


def test_serve_names_the_extra_when_starlette_or_uvicorn_is_missing() -> None:
    for name in ("starlette", "uvicorn"):
        run = subprocess.run([sys.executable, "-c", SERVE_WITHOUT.format(name=name)], capture_output=True, text=True,
                             timeout=120)
        assert (run.returncode, run.stdout) == (1, ""), run.stderr
        assert run.stderr.strip().splitlines() == [
            f"asyncllm serve: the server is not installed (import of {name} halted; None in sys.modules): "
            "pip install 'asyncllm[server]'"]
