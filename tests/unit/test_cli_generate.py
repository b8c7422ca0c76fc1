"""`asyncllm generate` takes serve's and engine's engine flags, refuses an empty prompt before anything starts, and a
Ctrl-C (a hub id looked up, the model loading, the command still importing) is exit 130 with no traceback, as serve's
(asyncllm/cli.py, asyncllm/__main__.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from asyncllm import cli, cli_commands
from asyncllm.errors import InvalidRequestError


def test_generate_takes_the_engine_flags_and_its_seed_is_the_requests() -> None:
    args = cli.parse_args(cli._parser(), ["generate", "--trust-remote-code", "--device", "cpu", "--max-model-len", "128",
                                          "-tp", "1", "--dtype", "float32", "--seed", "3", "x"])
    config, params = cli._generate_setup(args)
    assert (config.model_config.trust_remote_code, config.model_config.device) == (True, "cpu")
    assert (config.model_config.max_model_len, config.model_config.dtype) == (128, "float32")
    assert params.seed == 3 and config.model_config.seed != 3  # --seed is the request's, not the engine's


def test_an_empty_prompt_is_refused_before_the_model_is_looked_up(monkeypatch) -> None:
    def no_model(config: object) -> None:
        raise AssertionError("the model was looked up")

    monkeypatch.setattr(cli, "check_model", no_model)
    args = cli.parse_args(cli._parser(), ["generate", "--model", "/no/such/folder", ""])
    with pytest.raises(InvalidRequestError, match="the prompt is empty"):
        cli._generate_setup(args)


def _interrupted(*args: object) -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize("command", [["generate", "x"], ["serve", "--port", "0"]])
def test_ctrl_c_while_the_model_is_looked_up_is_exit_130_quietly(monkeypatch, capsys, command) -> None:
    monkeypatch.setattr(cli, "check_model", _interrupted)
    monkeypatch.setattr(cli_commands, "check_model", _interrupted)
    try:
        cli.main(command)
    except BaseException as exc:  # noqa: BLE001 - a KeyboardInterrupt let through must fail the test, not end pytest
        ended = exc
    assert isinstance(ended, SystemExit) and ended.code == 130, repr(ended)
    assert "Traceback" not in capsys.readouterr().err


def test_the_engine_core_ignores_ctrl_c_from_its_first_import() -> None:
    """A Ctrl-C while a host's core child still imports (before its main() ignores the group's signals) is the host's:
    no traceback from the child. ``--help`` ends main() before it ignores anything itself."""
    import subprocess
    import sys

    code = ("import runpy, signal, sys\nsys.argv = ['core', '--help']\ntry:\n"
            "    runpy.run_module('asyncllm.engine.core', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.splitlines()[-1] == "True"


_CTRL_C_WHILE_IMPORTING = """
import importlib.abc, os, signal, sys

class CtrlC(importlib.abc.MetaPathFinder):  # a Ctrl-C as the command imports the engine's config
    def find_spec(self, name, path=None, target=None):
        if name == "asyncllm.config":
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlC())
sys.argv = ["asyncllm", "generate", "x"]
"""


def _console_script() -> str:
    """What pip's ``asyncllm`` script runs: pyproject's entry point, imported then called."""
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    module, func = re.search(r'^asyncllm = "([\w.]+):(\w+)"', text, re.M).groups()
    return f"from {module} import {func}\nsys.exit({func}())"


@pytest.mark.parametrize("run", ["script", "python -m"])
def test_ctrl_c_while_the_command_imports_is_exit_130_quietly(run: str) -> None:
    code = _CTRL_C_WHILE_IMPORTING + (_console_script() if run == "script" else
                                      "import runpy\nrunpy.run_module('asyncllm', run_name='__main__', alter_sys=True)")
    ended = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (ended.returncode, ended.stderr) == (130, ""), ended.stderr  # uncaught: a traceback and -SIGINT


def test_generate_takes_the_models_generation_config_and_a_closed_pipe_quietly(tmp_path) -> None:
    """Without --max-tokens / --temperature the request is the model's generation config's (here its overrides:
    greedy, 2 tokens; a second greedy run of 200 tokens begins with the same text); a reader that leaves early
    (``| head``) ends it without a traceback."""
    command = [sys.executable, "-m", "asyncllm", "generate", "--override-generation-config"]
    run = subprocess.run([*command, '{"max_new_tokens": 2, "temperature": 0}'], capture_output=True, timeout=300)
    assert run.returncode == 0 and b"finish_reason=length" in run.stderr, run.stderr[-1500:]
    assert len(run.stdout) < len("def fibonacci(n):") + 40  # 2 tokens of text, not 64
    reader = subprocess.Popen([*command, '{"max_new_tokens": 200, "temperature": 0}'],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    begins = reader.stdout.read(len(run.stdout))
    reader.stdout.close()  # the reader left
    _, err = reader.communicate(timeout=300)
    assert begins == run.stdout  # greedy both times: the temperature override was taken
    assert b"Traceback" not in err and reader.returncode in (0, 141), err[-1500:]
