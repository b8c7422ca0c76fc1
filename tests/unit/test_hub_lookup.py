"""A hub id's lookup (asyncllm/models/hub.py) without a network: a hub that accepts connections and never answers
(a network that drops packets) makes a cached snapshot load within HF_HUB_ETAG_TIMEOUT, and an uncached one a
ConfigError saying the hub could not be reached; a path that is not a folder says so."""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path

import pytest
from model_utils import tiny_hf_config

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.architectures import architecture_of
from asyncllm.models import hub
from asyncllm.models.hub import resolve_model_path

_COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def silent_hub(monkeypatch: pytest.MonkeyPatch):
    """HF_ENDPOINT at a local server that accepts and never answers; lookups wait 0.5 s."""
    from huggingface_hub import constants

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted: list[socket.socket] = []
    thread = threading.Thread(target=lambda: _accept_forever(server, accepted), daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)  # huggingface_hub reads HF_ENDPOINT at its import
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "1")  # huggingface_hub's int()
    monkeypatch.setitem(hub._unanswered, "at", None)  # no earlier test's unanswered lookup
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    yield accepted
    server.close()
    for conn in accepted:
        conn.close()


def _accept_forever(server: socket.socket, accepted: list[socket.socket]) -> None:
    while True:
        try:
            accepted.append(server.accept()[0])
        except OSError:  # closed
            return


def _cached_snapshot(cache: Path) -> Path:
    repo = cache / "models--myorg--tiny"
    snapshot = repo / "snapshots" / _COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model.safetensors").write_bytes(b"")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(_COMMIT)
    return snapshot


def test_a_silent_hub_reads_the_cached_snapshot(tmp_path, monkeypatch, silent_hub, caplog):
    snapshot = _cached_snapshot(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="asyncllm.models.hub"):
        path = resolve_model_path("myorg/tiny")
    assert Path(path).resolve() == snapshot.resolve()
    assert time.monotonic() - started < 8 and silent_hub  # the hub was asked, and not waited for
    assert "HF_HUB_OFFLINE=1" in caplog.text and "HF_HUB_ETAG_TIMEOUT" in caplog.text
    asked = len(silent_hub)
    assert resolve_model_path("myorg/tiny", weights=False) == path and len(silent_hub) == asked  # not asked again


def test_a_silent_hub_and_no_cache_is_one_config_error(tmp_path, monkeypatch, silent_hub):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        resolve_model_path("myorg/absent")
    message = str(info.value)
    assert time.monotonic() - started < 8
    assert "hub could not be reached" in message and str(tmp_path) in message and "\n" not in message
    assert "HF_HUB_OFFLINE=0" not in message  # offline mode is not on: it is not the advice


@pytest.mark.parametrize("model", ["/no/such/folder/anywhere", "./my-modle", "../my-modle", "~/no-such-model-dir",
                                   ".cache/no-such-model", "~no-such-user-4f1/model"])
def test_a_path_that_is_not_a_folder_says_so(model):
    """The served model's rule and `update_weights`' are one (`hub.names_a_path`): no hub id begins with ``.``."""
    from asyncllm.engine.weight_update import resolve_update_path
    from asyncllm.errors import InvalidRequestError

    with pytest.raises(ConfigError, match="no such folder: ") as info:
        resolve_model_path(model)
    assert "Repo id" not in str(info.value)
    with pytest.raises(InvalidRequestError, match="is not a folder"):
        resolve_update_path(model, None)


def test_a_home_folder_is_expanded(tmp_path, monkeypatch):
    """``~/x`` that exists is that folder (a typo'd one says "no such folder" with the expanded path)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "model").mkdir()
    assert resolve_model_path("~/model") == str(tmp_path / "model")


def test_an_unsupported_architecture_names_the_folder():
    config = tiny_hf_config("llama", architectures=["BertForMaskedLM"])
    config._name_or_path = "/models/my-bert"
    with pytest.raises(NotBuiltError) as info:
        architecture_of(config)
    assert info.value.value == "/models/my-bert" and "BertForMaskedLM architecture (supported: Llama" in str(info.value)
