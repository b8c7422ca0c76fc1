"""A host's private socket folder (asyncllm/ipc_dirs.py) goes when the host exits without aclose(), and not when a
process forked from it exits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

HOST = textwrap.dedent(
    """
    import asyncio, os, sys
    from asyncllm import AsyncEngine

    ENGINE = AsyncEngine(sys.argv[1], disable_log_stats=True, max_model_len=128, num_gpu_blocks_override=32)
    asyncio.run(ENGINE.start())  # held to the end: no finalizer stops it, the exit does
    folder = ENGINE._core.ipc_dir
    child = os.fork()
    if child == 0:
        sys.exit(0)  # a normal exit, atexit hooks run: the parent's folder is not the child's to remove
    os.waitpid(child, 0)
    print(folder, os.path.isdir(folder), flush=True)
    """
)


def test_a_host_that_exits_without_aclose_leaves_no_socket_folder(tiny_llama: str, tmp_path) -> None:
    env = {**os.environ, "ASYNCLLM_RUNTIME_DIR": str(tmp_path)}
    host = subprocess.run([sys.executable, "-c", HOST, tiny_llama], env=env, capture_output=True, text=True,
                          timeout=120)
    assert host.returncode == 0, host.stderr
    folder, kept = host.stdout.split()
    assert os.path.dirname(folder) == str(tmp_path) and kept == "True"  # there until the host's exit
    assert not os.path.exists(folder) and not [name for name in os.listdir(tmp_path) if name.startswith("asyncllm-")]
