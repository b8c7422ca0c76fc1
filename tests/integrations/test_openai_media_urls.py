"""The OpenAI server's media urls: a client never names a server file (vLLM's --allowed-local-media-path)."""

from __future__ import annotations

import pytest

from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.integrations.openai_messages import chat_messages
from asyncllm.integrations.openai_protocol import ServerLimits


def test_a_client_names_server_files_only_as_file_urls_inside_the_allowed_folder(tmp_path) -> None:
    """As vLLM's --allowed-local-media-path: a bare path (the engine would open it) is never taken from a client;
    file:// only inside the folder, symbolic links resolved; data: and http(s) pass to the engine as they are."""
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "cat.png").write_bytes(b"png")
    (tmp_path / "secret.png").write_bytes(b"png")
    (tmp_path / "ok" / "link.png").symlink_to(tmp_path / "secret.png")
    root = ServerLimits(allowed_local_media_path=str(tmp_path / "ok" / ".." / "ok")).allowed_local_media_path

    def url_of(url: str, media_root=root) -> str:
        part = {"type": "image_url", "image_url": {"url": url}}
        return chat_messages([{"role": "user", "content": [part]}], True, media_root)[0]["content"][0]["image_url"]["url"]

    for url in (f"file://{tmp_path}/ok/cat.png", f"FILE://{tmp_path}/ok/cat.png", f"file:{tmp_path}/ok/cat.png"):
        assert url_of(url) == str(tmp_path / "ok" / "cat.png")
    assert url_of("data:image/png;base64,AAAA") == "data:image/png;base64,AAAA"
    assert url_of("https://example.com/a.png", None) == "https://example.com/a.png"  # the engine refuses it
    refused = {str(tmp_path / "ok" / "cat.png"): "data:, http", f"file://{tmp_path}/secret.png": "must be inside",
               f"file://{tmp_path}/ok/../secret.png": "must be inside", f"file://{tmp_path}/ok/link.png": "must be inside",
               f"file://evil.host{tmp_path}/ok/cat.png": "must be inside", "ftp://x/y.png": "data:, http",
               "DATA:/../etc/passwd": "data:, http", " data:x": "data:, http", "da\tta:/etc/passwd": "data:, http",
               "HTTP://x/y": "data:, http", f"file://{tmp_path}/ok/a%00b.png": "not a valid path"}
    for url, message in refused.items():
        with pytest.raises(InvalidRequestError, match=message):
            url_of(url)
    with pytest.raises(InvalidRequestError, match="without --allowed-local-media-path"):
        url_of(f"file://{tmp_path}/ok/cat.png", None)
    with pytest.raises(ConfigError, match="allowed_local_media_path"):
        ServerLimits(allowed_local_media_path=str(tmp_path / "secret.png"))


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {}}, {"type": "image_url", "image_url": None},
                                  {"type": "image_url", "image_url": {"url": ""}},
                                  {"type": "video_url", "video_url": {"url": 5}},
                                  {"type": "image_url", "image_url": {"url": "/etc/hostname"}}])
def test_a_missing_or_refused_url_names_its_part_as_the_engines_media_errors(part) -> None:
    """``messages[i].content[j]``, as an undecodable image is named by the engine, not the whole ``messages``."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "user", "content": [{"type": "text", "text": "look"}, part]}]
    with pytest.raises(InvalidRequestError) as caught:
        chat_messages(messages, True, None)
    assert caught.value.field == "messages[1].content[1]", caught.value
