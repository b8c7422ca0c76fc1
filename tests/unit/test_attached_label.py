"""The model name a core gives attached hosts (`Ready.model`): the model as its launcher named it, which an attached
host labels its metrics with (vLLM labels with the model as given, never the folder it resolved to)."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from asyncllm import protocol
from asyncllm.bundled import BUNDLED_MODEL_NAME, bundled_model_path
from asyncllm.config import EngineConfig
from asyncllm.engine import standalone
from asyncllm.engine.core import EngineCore
from test_standalone_stop import _FakeIO


class _Started(Exception):
    """Raised by the stand-in core once it recorded how it was made."""


@pytest.mark.parametrize("given", ["acme/tiny-llama", "bundled"])
def test_a_standalone_core_names_the_model_as_given_not_its_folder(given, monkeypatch, tmp_path) -> None:
    given = bundled_model_path() if given == "bundled" else given
    made: list[tuple[str, str]] = []

    def core(config: SimpleNamespace, io: _FakeIO, hf_config_json: object, auto_fit: bool, model_name: str) -> None:
        made.append((config.model, model_name))
        raise _Started

    folder = SimpleNamespace(model="/cache/models--acme--tiny-llama/snapshots/0123", max_model_len=128)
    monkeypatch.setattr(standalone, "prepare", lambda config, decodes_images: SimpleNamespace(
        config=folder, hf_config_json=None))
    monkeypatch.setattr(standalone, "CoreIO", _FakeIO)
    monkeypatch.setattr(standalone, "EngineCore", core)
    monkeypatch.setattr(standalone, "configure_child_logging", lambda tag: None)
    monkeypatch.setattr(standalone, "report_crashes", lambda: None)
    config = SimpleNamespace(data_parallel_size=1, max_model_len=128, model=given)
    with pytest.raises(_Started):
        standalone.run_standalone_core(config, f"ipc://{tmp_path}/e.sock")
    label = BUNDLED_MODEL_NAME if given == bundled_model_path() else given
    assert made == [(folder.model, label)]  # the core serves the folder, named as given


def test_the_cores_ready_names_the_model_as_its_launcher_did() -> None:
    config = EngineConfig.create("acme/tiny-llama", max_model_len=128)
    core = SimpleNamespace(config=config, num_gpu_blocks=8, model_name="acme/tiny-llama")
    ready = EngineCore._ready(core)  # type: ignore[arg-type]
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(ready), type=protocol.CoreMessage)
    assert isinstance(wire, protocol.Ready) and wire.model == "acme/tiny-llama"


@pytest.mark.parametrize("name", ["acme/tiny-llama", "-served"])
def test_an_owned_core_parses_the_model_name_its_host_launched_it_with(name, monkeypatch, tmp_path) -> None:
    """`launch_core`'s arguments as the core's `main` parses them: a served name may start with "-" (a separate
    value would read as an option, and the core would exit at once)."""
    from asyncllm.engine import core, launch

    spawned: list[list[str]] = []
    monkeypatch.setattr(launch.procutil, "spawn_module", lambda module, args, env: spawned.append(args))
    monkeypatch.setattr(launch.procutil, "private_ipc_dir", lambda: str(tmp_path))
    monkeypatch.setattr(launch, "CoreProcess", lambda proc, address, ipc_dir: None)
    launch.launch_core(EngineConfig.create("acme/tiny-llama", max_model_len=128), model_name=name)
    monkeypatch.setattr(core, "exit_when_parent_dies", lambda: (_ for _ in ()).throw(_Started()))  # parsed
    with pytest.raises(_Started):
        core.main(spawned[0])
