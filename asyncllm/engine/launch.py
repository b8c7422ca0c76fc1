"""Start and stop the engine-core process that a host owns."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

import msgspec

from asyncllm import errors, procutil
from asyncllm.child_logging import host_logging_env
from asyncllm.config import EngineConfig
from asyncllm.workers.trace_summary import wait_for_exit

_LOGS = "the core and its workers log to this process's stderr, tracebacks included"


@dataclass
class CoreProcess:
    """An engine core started by this host, listening on `address`."""

    proc: subprocess.Popen
    address: str
    ipc_dir: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def death(self, when: str = "", wait_s: float = 0.0) -> errors.EngineDeadError | None:
        """The error that says how the core process ended (`when`: " while starting"), waiting up to `wait_s` for
        it to end; None while it runs."""
        try:
            code = self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return None
        return errors.EngineDeadError(f"engine core (pid {self.pid}) {procutil.describe_exit(code)}{when}; {_LOGS}")

    def stop(self, timeout: float = 10.0, told: bool = True) -> None:
        """After Goodbye(shutdown=True) (`told`) the core shuts its workers down and exits: wait for that before
        cutting its lifeline. A core not told (closed while it started, before it reads messages) is cut at once:
        its stdin's EOF ends it, and its workers with it. A worker of this core writing its step trace is waited
        for past `timeout`, a few minutes at most (`wait_for_exit`: the core waits for it too)."""
        if told:
            wait_for_exit(self.proc, timeout)
        procutil.stop_process(self.proc, timeout)
        procutil.remove_dir(self.ipc_dir)


def launch_core(config: EngineConfig, hf_config_json: str | None = None,
                env: dict[str, str] | None = None, auto_fit: bool = False, model_name: str = "") -> CoreProcess:
    """Spawn ``python -m asyncllm.engine.core`` on a private ipc:// socket.

    `hf_config_json` is the checkpoint's config as the host read it; the
    workers build their model from it instead of reading it again. `env` is
    added to the core's environment, which its workers inherit (a
    data-parallel replica's CUDA_VISIBLE_DEVICES). `auto_fit` (the user's
    max_model_len -1): the core lowers `config`'s max_model_len to what the
    KV cache holds and says so in its `protocol.Ready`. `model_name`: the host's metrics label, which the core
    names in its `Ready` (`Ready.model`).
    """
    env = {**host_logging_env(), **(env or {})}  # first: a bad logging variable leaves no folder behind
    ipc_dir = procutil.private_ipc_dir()
    address = f"ipc://{os.path.join(ipc_dir, 'core.sock')}"
    config_json = msgspec.json.encode(config.to_dict(wire=True)).decode()
    extra = ["--hf-config-json", hf_config_json] if hf_config_json is not None else []
    extra += ["--auto-max-model-len"] if auto_fit else []
    extra += [f"--model-name={model_name}"] if model_name else []  # one token: a name may start with "-"
    proc = procutil.spawn_module(
        "asyncllm.engine.core", ["--address", address, "--config-json", config_json, *extra], env
    )
    return CoreProcess(proc, address, ipc_dir)
