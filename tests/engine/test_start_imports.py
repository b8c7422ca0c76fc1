"""Where an engine is made decides where transformers and torch are imported: before the loop runs, in the
constructor; inside a running loop, on the start's preparation thread (asyncllm/engine/off_loop.py)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

_IMPORTS_BY_WHERE_MADE = """
import asyncio, sys
from asyncllm import AsyncEngine
async def in_loop():
    AsyncEngine(sys.argv[1])
asyncio.run(in_loop())
print("torch" in sys.modules, "transformers" in sys.modules)
AsyncEngine(sys.argv[1])
print("torch" in sys.modules, "transformers" in sys.modules)
"""


def test_an_engine_made_before_the_loop_imports_transformers_then_not_on_the_loop(tiny_llama: str,
                                                                                    tmp_path: Any) -> None:
    """Made inside a running loop, the constructor imports nothing (a blocking import would stall that loop);
    made where no loop runs, it imports transformers and torch, whose import on the start's preparation thread
    would hold the GIL and stall the loop later (`import_before_the_loop`)."""
    done = subprocess.run([sys.executable, "-c", _IMPORTS_BY_WHERE_MADE, tiny_llama], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-2:] == ["False False", "True True"]
