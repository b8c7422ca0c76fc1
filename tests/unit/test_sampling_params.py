"""`SamplingParams`: every field validated with an error naming it; n > 1 fan-out parameters."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from asyncllm import InvalidRequestError, RequestOutputKind, SamplingParams, StructuredOutputs
from asyncllm.engine.processor import sample_request_ids
from asyncllm.sampling import sample_seed


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0), ("n", 1.5), ("temperature", -0.1), ("top_p", 0.0), ("top_k", -2), ("min_p", 1.5),
        ("seed", -(2**63) - 1), ("seed", 2**63), ("max_tokens", 0), ("min_tokens", -1), ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("frequency_penalty", "1"),
        ("repetition_penalty", 0.0), ("repetition_penalty", float("inf")), ("repetition_penalty", float("nan")),
        ("repetition_penalty", 1e-30),  # float32 logits divided by it overflow to inf (token 0 sampled)
        ("logit_bias", {1: 101.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", {1: "x"}), ("logit_bias", [1.0]),
        ("logit_bias", {"abc": 1.0}), ("logit_bias", {"¹": 1.0}), ("logprobs", -2), ("logprobs", 2**31),
        ("logprobs", True), ("prompt_logprobs", 2**31), ("prompt_logprobs", -2), ("output_kind", "sometimes"),
        ("output_kind", 5), ("skip_special_tokens", 1), ("logprobs_mode", "logits"),
    ],
)
def test_each_bad_value_names_its_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value}).validate()
    assert info.value.field == field


def test_minus_one_values_are_vllms() -> None:
    """seed -1 is no seed; other int64 seeds are valid, negative ones too; logprobs / prompt_logprobs -1 ask for the
    whole vocabulary (the engine's max_logprobs must allow it: `check_logprobs_limit`)."""
    from asyncllm.engine.validation import check_logprobs_limit

    assert SamplingParams(seed=-1).seed is None
    p = SamplingParams(seed=-(2**63), logprobs=-1, prompt_logprobs=-1)
    p.validate()
    assert p.seed == -(2**63) and msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p
    for max_logprobs, vocab in ((-1, 512), (512, 512)):
        check_logprobs_limit(p, max_logprobs, vocab)
    with pytest.raises(InvalidRequestError, match="whole vocabulary") as info:
        check_logprobs_limit(p, 511, 512)
    assert info.value.field == "logprobs"
    SamplingParams(truncate_prompt_tokens=-1).validate()
    with pytest.raises(InvalidRequestError, match=r"must be -1 or in \[1, 2147483647\], got -2"):
        SamplingParams(truncate_prompt_tokens=-2).validate()


def test_min_tokens_above_max_tokens_names_min_tokens() -> None:
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4).validate()


def test_defaults_are_vllms_and_valid() -> None:
    p = SamplingParams()
    p.validate()
    assert (p.n, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (1, 0.0, 0.0, 1.0)
    assert (p.logit_bias, p.logprobs, p.prompt_logprobs, p.output_kind) == (None, None, None, RequestOutputKind.DELTA)


def test_convenient_spellings_are_normalised() -> None:
    p = SamplingParams(logit_bias={"17": 5, 3: -1.5}, output_kind="final_only", stop="x")
    p.validate()
    assert p.logit_bias == {17: 5, 3: -1.5} and p.output_kind is RequestOutputKind.FINAL_ONLY and p.stop == ["x"]
    assert SamplingParams(output_kind=0).output_kind is RequestOutputKind.CUMULATIVE


def test_repeated_token_ids_are_sent_once() -> None:
    """stop_token_ids and allowed_token_ids are sets: a long list of repeats ships as its distinct ids, first-seen
    order, so what reaches the core and the workers is bounded by the vocabulary."""
    p = SamplingParams(stop_token_ids=[7, 3, 7] * 100_000, allowed_token_ids=[5, 2] * 100_000 + [9])
    p.validate()
    assert (p.stop_token_ids, p.allowed_token_ids) == ([7, 3], [5, 2, 9])


def test_vllms_none_for_a_list_field_is_the_empty_list() -> None:
    """vLLM's SamplingParams defaults stop, stop_token_ids and bad_words to None: the same request here, the same
    wire form; allowed_token_ids and logit_bias keep None (no restriction, no bias)."""
    p = SamplingParams(stop=None, stop_token_ids=None, bad_words=None, bad_words_token_ids=None,
                       allowed_token_ids=None, logit_bias=None)
    p.validate()
    assert p == SamplingParams() and msgspec.msgpack.encode(p) == msgspec.msgpack.encode(SamplingParams())
    assert (p.stop, p.stop_token_ids, p.bad_words, p.allowed_token_ids, p.logit_bias) == ([], [], [], None, None)


def test_round_trips_the_wire_with_every_new_field() -> None:
    p = SamplingParams(n=3, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                       logit_bias={5: 2.0}, logprobs=3, prompt_logprobs=0, output_kind=RequestOutputKind.CUMULATIVE,
                       logprobs_mode="raw_logprobs")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p


def test_check_vocab_names_logit_bias() -> None:
    SamplingParams(logit_bias={99: 1.0}).check_vocab(100)
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(logit_bias={100: 1.0}).check_vocab(100)
    assert info.value.field == "logit_bias"


def test_a_start_after_in_two_parts_is_checked() -> None:
    """gpt-oss's constraint start (`StructuredOutputs.start_after_suffix`): its suffix's ids against the vocabulary,
    its fields' shape when the request is made."""
    two_parts = StructuredOutputs(regex="a", start_after_token_ids=[1], start_after_suffix_token_ids=[99],
                                  start_after_max_between=20)
    SamplingParams(structured=two_parts).check_vocab(100)
    with pytest.raises(InvalidRequestError, match=r"\[100\]"):
        SamplingParams(structured=msgspec.structs.replace(two_parts, start_after_suffix_token_ids=[100])).check_vocab(100)
    with pytest.raises(InvalidRequestError, match=r"\[100\]"):  # mistral's [THINK] (start_after_only_if_reply_opens)
        SamplingParams(structured=msgspec.structs.replace(two_parts, start_after_opener_token_ids=[100])).check_vocab(100)
    for bad, why in [({"start_after_max_between": 0}, "at least 1 with a suffix"),
                     ({"start_after_suffix_token_ids": [-1]}, "start_after_suffix_token_ids must be"),
                     ({"start_after_suffix": "<|message|>"}, "after a start_after"),
                     ({"start_after_only_if_opened": True}, "start_after_only_if_opened needs a start_after"),
                     ({"start_after_only_if_reply_opens": True}, "start_after_only_if_reply_opens needs a start_after"),
                     ({"start_after_opener_token_ids": [-1]}, "start_after_opener_token_ids must be"),
                     ({"start_after": "[/THINK]", "start_after_only_if_reply_opens": True,
                       "start_after_opener_token_ids": [3, 4]}, "holds at most one token id"),
                     ({"start_after": "[/THINK]", "start_after_opener_token_ids": [3]},
                      "start_after_opener_token_ids needs start_after_only_if_reply_opens"),
                     ({"start_after_opener": "<think>"}, "start_after_opener must be a non-empty string after"),
                     ({"start_after": "</think>", "start_after_opener": ""}, "start_after_opener must be"),
                     ({"start_after": "<|channel|>final", "start_after_suffix": "<|message|>",
                       "start_after_opener": "<think>"}, "without a start_after_suffix")]:
        with pytest.raises(InvalidRequestError, match=why):
            msgspec.structs.replace(two_parts, **bad).validate()


def test_samples_of_an_n_request() -> None:
    p = SamplingParams(n=3, seed=42, prompt_logprobs=2, logprobs=1)
    samples = [p.for_sample(i) for i in range(3)]
    assert [s.n for s in samples] == [1, 1, 1] and [s.logprobs for s in samples] == [1, 1, 1]
    assert [s.prompt_logprobs for s in samples] == [2, None, None]  # computed once, by sample 0
    assert samples[0].seed == 42 and len({s.seed for s in samples}) == 3
    assert sample_seed(42, 1) != sample_seed(43, 0) and sample_seed(42, 1) == samples[1].seed
    assert SamplingParams(n=2).for_sample(1).seed is None
    assert sample_request_ids("abc", 1, 7) == ["abc#7"]
    assert sample_request_ids("abc", 3, 8) == ["abc#8-0", "abc#8-1", "abc#8-2"]


@pytest.mark.parametrize(("field", "value"), [
    ("bad_words", [f"w{i}" for i in range(129)]),  # vLLM's 128 sequences: refused before any is tokenized
    ("bad_words", ["x" * (1024 * 64 + 1)]),
    ("bad_words_token_ids", [[5]] * 129),
    ("bad_words_token_ids", [[5] * 1025]),
])
def test_bad_words_are_bounded_as_vllms(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value}).validate()
    assert info.value.field == field
    SamplingParams(**{field: value[:128] if len(value) > 1 else [value[0][:1024]]}).validate()


def test_bad_words_bounds_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCLLM_MAX_NUM_BAD_WORDS", "2")
    monkeypatch.setenv("ASYNCLLM_MAX_BAD_WORDS_TOTAL_TOKENS", "3")
    SamplingParams(bad_words_token_ids=[[1], [2, 3]]).validate()
    for sequences in ([[1], [2], [3]], [[1, 2], [3, 4]]):
        with pytest.raises(InvalidRequestError, match="bad_words_token_ids"):
            SamplingParams(bad_words_token_ids=sequences).validate()


def test_numpy_scalars_are_taken_as_python_numbers() -> None:
    """An ``np.linspace`` sweep's temperature, numpy seeds and logit_bias entries validate and cross the wire as
    Python numbers (vLLM takes them); a numpy value out of range is still refused by name."""
    import msgspec
    import numpy as np

    params = SamplingParams(temperature=np.linspace(0, 1, 5)[2], top_p=np.float32(0.5), seed=np.int64(7),
                            max_tokens=np.int32(3), logit_bias={np.int64(4): np.float64(-1.5)})
    params.validate()
    assert (params.temperature, params.top_p, params.seed, params.max_tokens) == (0.5, 0.5, 7, 3)
    assert [type(v) for v in (params.temperature, params.seed)] == [float, int] and params.logit_bias == {4: -1.5}
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams).logit_bias == {4: -1.5}
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(top_p=np.float64(1.5)).validate()
    assert info.value.field == "top_p"
