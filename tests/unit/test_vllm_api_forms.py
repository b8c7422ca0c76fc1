"""Without an engine: `check_prompt`'s reading of a list of prompts (named batch call) and of an empty text (left to
the tokenizer), `AsyncEngine.abort`'s request ids, and `SyncEngine`'s wrappers of `transcribe` (a sync iterator),
`transcribe_segments`, `classify`, `score`, `add_lora` and `remove_lora` over a stand-in engine."""

from __future__ import annotations

import pytest

from asyncllm import AsyncEngine, InvalidRequestError
from asyncllm.engine.engine_requests import _request_ids
from asyncllm.engine.stream import check_prompt
from asyncllm.integrations.sync import SyncEngine


@pytest.mark.parametrize("prompt", ["", "x", [1, 2], (3,), {"prompt": ""}])
def test_one_prompt_passes(prompt) -> None:
    check_prompt(prompt, chat=False)


@pytest.mark.parametrize("prompts", [["a", "b"], [{"prompt": "a"}], [[1], [2]], (("a",),)])
def test_a_list_of_prompts_names_the_batch_call(prompts) -> None:
    with pytest.raises(InvalidRequestError, match="generate_many") as info:
        check_prompt(prompts, chat=False)
    assert info.value.field == "prompt" and f"a list of {len(prompts)} prompts" in info.value.message
    for task in ("embed", "classify"):
        with pytest.raises(InvalidRequestError, match=f"no batch {task} call") as info:
            check_prompt(prompts, chat=False, pooling_task=task)
        assert "generate_many" not in info.value.message


def test_empty_token_ids_are_still_refused() -> None:
    with pytest.raises(InvalidRequestError, match="the prompt is empty"):
        check_prompt([], chat=False)


def test_abort_request_ids() -> None:
    assert _request_ids("a") == {"a"} and _request_ids(["a", "b", "a"]) == {"a", "b"} and _request_ids(()) == set()
    for bad in (3, [b"a"], None):
        with pytest.raises(InvalidRequestError) as info:
            _request_ids(bad)
        assert info.value.field == "request_id"


async def test_abort_on_an_engine_never_started_is_a_no_op() -> None:
    await AsyncEngine().abort("anything")  # constructing starts nothing; nothing runs under that id


class _Engine:
    """Records what each call got; its coroutines and generator run on the SyncEngine's loop."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.closed_early = False

    async def transcribe_segments(self, audio, **options):
        self.calls.append(("transcribe_segments", audio, options))
        return ["segment"]

    async def classify(self, prompt, **options):
        self.calls.append(("classify", prompt, options))
        return "verdict"

    async def score(self, text_1, text_2, **options):
        self.calls.append(("score", text_1, text_2, options))
        return ["score"]

    async def add_lora(self, lora_request):
        self.calls.append(("add_lora", lora_request))

    async def remove_lora(self, lora_id):
        self.calls.append(("remove_lora", lora_id))
        return True

    async def transcribe(self, audio, **options):
        self.calls.append(("transcribe", audio, options))
        try:
            for text in ("one ", "two ", "three"):
                yield text
        except GeneratorExit:
            self.closed_early = True
            raise

    async def aclose(self) -> None:
        pass


@pytest.fixture
def faked():
    fake = _Engine()
    engine = SyncEngine.__new__(SyncEngine)
    engine._setup(lambda: fake)
    yield engine, fake
    engine.close()


def test_sync_wrappers_pass_their_arguments_through(faked) -> None:
    engine, fake = faked
    assert engine.classify([1, 2], priority=1) == "verdict"
    assert engine.score("q", ["d"], timeout=2.0) == ["score"]
    assert engine.transcribe_segments(b"wav", language="de") == ["segment"]
    assert engine.add_lora("lora") is None and engine.remove_lora(4) is True
    assert fake.calls == [("classify", [1, 2], {"priority": 1}), ("score", "q", ["d"], {"timeout": 2.0}),
                          ("transcribe_segments", b"wav", {"language": "de"}), ("add_lora", "lora"),
                          ("remove_lora", 4)]


def test_sync_transcribe_iterates_and_a_loop_left_early_closes_it(faked) -> None:
    engine, fake = faked
    assert list(engine.transcribe(b"wav", task="translate")) == ["one ", "two ", "three"]
    assert fake.calls == [("transcribe", b"wav", {"task": "translate"})] and not fake.closed_early
    for _ in engine.transcribe(b"wav"):
        break  # its generator is closed on the loop (the pieces still running are aborted)
    assert fake.closed_early
