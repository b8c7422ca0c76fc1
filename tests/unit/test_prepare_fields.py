"""Fields the host's preparation (asyncllm/engine/prepare.py) refuses by name rather than ignore: revisions of local
folders, and the multimodal fields of a model served as text."""

from __future__ import annotations

import pytest

from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError
from asyncllm.engine.prepare import prepare


@pytest.mark.parametrize(("fields", "field", "says"), [
    ({"revision": "v2"}, "revision", "None for a local model"),
    ({"tokenizer_revision": "v2"}, "tokenizer_revision", "None for a local model"),
    ({"tokenizer_revision": "v2", "tokenizer": "MODEL"}, "tokenizer_revision", "None for a local tokenizer"),
])
def test_a_revision_of_a_local_folder_is_refused(tiny_llama, fields, field, says) -> None:
    fields = {name: tiny_llama if value == "MODEL" else value for name, value in fields.items()}
    with pytest.raises(ConfigError, match=f"^{field}='v2' is not allowed: {says} .* has no revisions") as info:
        prepare(EngineConfig.create(tiny_llama, **fields))
    assert info.value.field == field


def test_a_revision_of_a_local_draft_folder_is_refused(tiny_llama) -> None:
    spec = {"model": tiny_llama, "num_speculative_tokens": 2, "revision": "v2"}
    with pytest.raises(ConfigError, match="^speculative_config.revision='v2' is not allowed: None for a local draft "
                                          "model .* has no revisions") as info:
        prepare(EngineConfig.create(tiny_llama, speculative_config=spec))
    assert info.value.field == "speculative_config.revision"


def test_a_prepared_configs_revisions_are_those_its_folders_were_resolved_at(tiny_llama) -> None:
    """A restart's config, or the shared core's an attached host takes, holds the local folders a hub id and its
    revisions resolved to: prepared again (``resolved``), its revisions are not refused."""
    served = prepare(EngineConfig.create(tiny_llama)).config.replace(revision="v2", tokenizer_revision="v2")
    again = prepare(served, resolved=True).config
    assert (again.model, again.revision, again.tokenizer_revision) == (tiny_llama, "v2", "v2")
    with pytest.raises(ConfigError, match="^revision="):
        prepare(served)


@pytest.mark.parametrize(("fields", "field"), [
    ({"limit_mm_per_prompt": {"image": 0, "video": 3}}, "limit_mm_per_prompt.video"),
    ({"limit_mm_per_prompt": {"audio": 2}}, "limit_mm_per_prompt.audio"),
    ({"limit_mm_per_prompt": {"image": 1}}, "limit_mm_per_prompt.image"),
    ({"mm_processor_kwargs": {"max_pixels": 1024}}, "mm_processor_kwargs"),
    ({"media_io_kwargs": {"video": {"num_frames": 8}}}, "media_io_kwargs"),
])
def test_multimodal_fields_on_a_text_model_are_refused(tiny_llama, fields, field) -> None:
    with pytest.raises(ConfigError, match="LlamaForCausalLM is served as text") as info:
        prepare(EngineConfig.create(tiny_llama, **fields))
    assert info.value.field == field


def test_multimodal_fields_asking_for_nothing_pass_on_a_text_model(tiny_llama) -> None:
    """... and ``mm_max_image_pixels`` above PIL's bound: only a multimodal model's preparation compares them."""
    config = EngineConfig.create(tiny_llama, limit_mm_per_prompt={"image": 0, "video": 0}, mm_processor_kwargs={},
                                 media_io_kwargs={}, mm_max_image_pixels=2**40)
    assert prepare(config).mm is None


def test_only_the_host_compares_mm_max_image_pixels_with_its_pil_limit(tmp_path, monkeypatch) -> None:
    """A standalone core (`asyncllm engine`) decodes no image: it prepares a multimodal model whatever its own PIL's
    limit; a host, which decodes them, refuses a bound above its PIL's."""
    from PIL import Image
    from mm_utils import make_tiny_llava

    from asyncllm.engine import standalone

    class Prepared(Exception):
        pass

    def claimed(socket_path: str) -> None:  # reached once the core prepared: stop there
        raise Prepared

    for name, stand_in in (("configure_child_logging", lambda what: None), ("report_crashes", lambda: None),
                           ("_claim_socket", claimed)):
        monkeypatch.setattr(standalone, name, stand_in)
    config = EngineConfig.create(make_tiny_llava(tmp_path / "llava"), mm_max_image_pixels=2 * Image.MAX_IMAGE_PIXELS + 1)
    with pytest.raises(Prepared):
        standalone.run_standalone_core(config, f"ipc://{tmp_path}/core.sock")
    with pytest.raises(ConfigError, match="mm_max_image_pixels=.*PIL's decompression-bomb limit"):
        prepare(config)
