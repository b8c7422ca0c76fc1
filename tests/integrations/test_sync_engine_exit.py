"""A `SyncEngine` never closed ends with its host: a stream left open to the interpreter's exit does not hang it (its
loop thread runs no more then), and one collected without close() closes its event loop (no file descriptor left)."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import time

from asyncllm.integrations import sync
from asyncllm.integrations.sync import SyncEngine

LEFT_OPEN = textwrap.dedent(
    """
    import sys, time
    from asyncllm.integrations.sync import SyncEngine

    class Stream:  # an endless stream (a real one's core ends with the host: its parent-death lifeline)
        exhausted = False

        async def __anext__(self):
            return "delta"

        async def aclose(self):
            pass

    ENGINE = SyncEngine(sys.argv[1])
    ENGINE.engine.stream = lambda *args, **kwargs: Stream()
    STREAM = ENGINE.stream("x")  # left open to the end: closed as this module is torn down
    next(STREAM)
    print(time.time(), flush=True)
    """
)


def test_a_stream_left_open_at_exit_lets_the_interpreter_exit(tiny_llama: str) -> None:
    host = subprocess.run([sys.executable, "-c", LEFT_OPEN, tiny_llama], capture_output=True, text=True, timeout=120)
    ended = time.time()
    assert host.returncode == 0, host.stderr
    assert ended - float(host.stdout) < sync.FINISH_WAIT_S / 2  # not waiting on a loop that runs no more


def test_a_sync_engine_collected_without_close_closes_its_loop(tiny_llama: str) -> None:
    engine = SyncEngine(tiny_llama)
    loop, thread = engine._loop, engine._thread
    del engine
    gc.collect()
    thread.join(10)
    assert not thread.is_alive() and loop.is_closed()
