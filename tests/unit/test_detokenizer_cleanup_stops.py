"""With ``clean_up_tokenization_spaces``, a stop string counts by the token whose text completed it, though clean-up
holds that text until later tokens come: min_tokens is judged by it, and the ids and logprobs after it never go out."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from transformers import AutoTokenizer

from asyncllm import protocol
from asyncllm.engine.collector import RequestCollector
from asyncllm.engine.detokenizer import IncrementalDetokenizer
from asyncllm.engine.logprobs import LogprobsDecoder
from asyncllm.engine.processor_outputs import ProcessorOutputs, TrackedRequest
from asyncllm.sampling import SamplingParams
from asyncllm.tiny import tiny_checkpoint


@pytest.fixture(scope="module")
def cleaning() -> Any:
    return AutoTokenizer.from_pretrained(
        tiny_checkpoint("llama"), clean_up_tokenization_spaces=True,
        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True)


def _words(tokenizer: Any) -> list[int]:
    """"I do n know more": clean-up holds " n" (token 4) and " " (token 5) until "k" (" n't" would become "n't")."""
    parts = ("I", " do", " n", " know", " more")
    ids = [i for part in parts for i in tokenizer(part, add_special_tokens=False).input_ids]
    assert tokenizer.convert_ids_to_tokens(ids[:6]) == ["I", "Ġd", "o", "Ġn", "Ġ", "k"]
    return ids


def test_stop_string_counts_by_the_token_that_completed_it(cleaning: Any) -> None:
    ids = _words(cleaning)
    detok = IncrementalDetokenizer(cleaning, [], SamplingParams(stop=["do n"]))
    finals = []
    for token_id in ids[:6]:
        update = detok.update([token_id], False)
        finals.append(detok.num_final)
    assert update.stop_string == "do n" and detok.token_ids == ids[:4]  # found on token 6, completed by token 4
    assert finals == [1, 2, 3, 4, 4, 4] and detok.output_text == "I "
    detok = IncrementalDetokenizer(cleaning, [], SamplingParams(stop=["do n"], min_tokens=4))
    texts = [detok.update([token_id], False).text for token_id in ids] + [detok.update([], True).text]
    assert detok.stop_string is None and "".join(texts) == cleaning.decode(ids)  # token 4 is within min_tokens


@pytest.mark.parametrize("min_tokens", [3, 4])
def test_stop_string_in_the_text_flushed_at_finish(cleaning: Any, min_tokens: int) -> None:
    ids, eos = _words(cleaning)[:4], cleaning.eos_token_id
    detok = IncrementalDetokenizer(cleaning, [], SamplingParams(stop=["do n"], min_tokens=min_tokens))
    assert [detok.update([token_id], False).text for token_id in ids] == ["I", " ", "", ""]
    update = detok.update([eos], True, stop_terminated=True)
    if min_tokens == 3:
        assert (update.stop_string, update.text, detok.token_ids) == ("do n", "", ids)  # the EOS after it dropped
    else:
        assert (update.stop_string, update.text, detok.token_ids) == (None, "do n", [*ids, eos])


def _outputs(tokenizer: Any) -> ProcessorOutputs:
    """A `ProcessorOutputs` with only what `_process_output` uses."""
    outputs = ProcessorOutputs.__new__(ProcessorOutputs)
    outputs._logprobs_decoder = LogprobsDecoder(tokenizer)
    outputs._tracked, outputs._samples, outputs._ending = {}, {}, []
    return outputs


def _delta(token_id: int, logprob: float) -> protocol.RequestOutputDelta:
    arrays = protocol.LogprobsArrays(1, np.int32([[token_id]]).tobytes(), np.float32([[logprob]]).tobytes(),
                                     np.int32([1]).tobytes())
    return protocol.RequestOutputDelta("r", [token_id], logprobs=arrays)


@pytest.mark.parametrize("stop", ["do n", "zz"])
def test_ids_and_logprobs_wait_while_a_stop_string_may_drop_them(cleaning: Any, stop: str) -> None:
    ids = _words(cleaning)[:6]
    outputs = _outputs(cleaning)
    tracked = outputs._tracked["r"] = TrackedRequest(
        RequestCollector("r", 0.0), IncrementalDetokenizer(cleaning, [], SamplingParams(stop=[stop], logprobs=0)))
    deltas = [outputs._process_output(tracked, _delta(token_id, -k - 1.0), 0.0, []) for k, token_id in enumerate(ids)]
    delivered = [d.token_ids for d in deltas]
    assert [[next(iter(entry)) for entry in d.logprobs] for d in deltas] == delivered
    if stop == "zz":  # tokens 5 and 6 go out together, once " n" and " " are released
        assert delivered == [[i] for i in ids[:4]] + [[], ids[4:6]]
        assert deltas[-1].cumulative_logprob == -21.0 and deltas[-1].finish_reason is None
    else:  # token 5 never goes out
        assert delivered == [[i] for i in ids[:4]] + [[], []]
        assert deltas[-1].cumulative_logprob == -10.0 and deltas[-1].finish_reason == "stop"


@pytest.mark.parametrize("finish_reason", ["stop", "abort"])
def test_held_logprobs_go_out_on_an_empty_final_delta(cleaning: Any, finish_reason: str) -> None:
    """A request ended by a delta without tokens (narrowing's "stop" after its trimmed tokens, a timeout): the tokens
    the flush releases take the logprobs held for them."""
    ids = _words(cleaning)[:5]
    outputs = _outputs(cleaning)
    tracked = outputs._tracked["r"] = TrackedRequest(
        RequestCollector("r", 0.0), IncrementalDetokenizer(cleaning, [], SamplingParams(stop=["zz"], logprobs=0)))
    deltas = [outputs._process_output(tracked, _delta(token_id, -k - 1.0), 0.0, []) for k, token_id in enumerate(ids)]
    assert deltas[-1].token_ids == [] and deltas[-1].cumulative_logprob == -10.0  # token 5 held with its logprob
    last = outputs._process_output(tracked, protocol.RequestOutputDelta("r", [], finish_reason), 0.0, [])
    assert last.token_ids == [ids[4]] and [next(iter(entry)) for entry in last.logprobs] == [ids[4]]
    assert last.cumulative_logprob == -15.0 and not tracked.held_logprobs
