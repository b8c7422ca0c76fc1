"""Speculative decoding's parts on their own: the config, the n-gram proposer, the scheduler's drafted steps
and the workers' verification (exact values)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncllm import protocol
from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.sampling import SamplingParams
from asyncllm.sched.request import Request
from asyncllm.sched.scheduler import Scheduler
from asyncllm.spec.config import SpeculativeConfig
from asyncllm.spec.ngram import NgramProposer
from asyncllm.workers.spec_decode import DraftedRequest, plan_drafted, verify_drafts

EOS = 2


# ------------------------------------------------------------------ config
def test_the_config_reads_vllm_s_dict_and_its_defaults():
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (4, 3, 3)
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2}) == SpeculativeConfig(2, 5, 5)
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}) \
        == SpeculativeConfig(2, 1, 1)
    config = EngineConfig.create("m", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert config.scheduler_config.speculative == SpeculativeConfig(3, 5, 5)
    assert EngineConfig.create("m").scheduler_config.speculative is None


@pytest.mark.parametrize("value, error, words", [
    ({"method": "suffix", "num_speculative_tokens": 3}, NotBuiltError, "method='suffix'"),
    ({"model": "some/draft", "num_speculative_tokens": 3, "prompt_lookup_max": 2}, ConfigError,
     "unknown: prompt_lookup_max"),
    ({"method": "ngram"}, ConfigError, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, ConfigError, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, ConfigError,
     "prompt_lookup_min <= prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, ConfigError,
     "unknown: draft_tensor_parallel_size"),
    ({"num_speculative_tokens": 2}, ConfigError, "method='ngram'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": -1}, ConfigError,
     "prompt_lookup_max an int"),  # the key given, not the min it would default
    ("ngram", ConfigError, "a dict"),
])
def test_a_bad_or_unbuilt_config_is_refused_by_name(value, error, words):
    with pytest.raises(error, match="speculative_config") as info:
        EngineConfig.create("m", speculative_config=value)
    assert type(info.value) is error and words in str(info.value)


# ------------------------------------------------------------------ proposer
def _propose(tokens: list[int], k: int = 3, lo: int = 1, hi: int = 3, max_drafts: int = 99) -> list[int]:
    return NgramProposer(SpeculativeConfig(k, lo, hi)).propose(tokens, bytearray(), max_drafts)


def test_the_longest_matching_suffix_decides_the_drafts():
    # suffix [8, 9]: earlier only at 0 (-> 1, 2, 3); suffix [9] alone was last seen before 4
    assert _propose([8, 9, 1, 2, 3, 9, 4, 5, 6, 8, 9]) == [1, 2, 3]
    assert _propose([8, 9, 1, 2, 3, 9, 4, 5, 6, 7, 9], lo=1, hi=1) == [4, 5, 6]  # the latest [9] with 3 after it
    assert _propose([8, 9, 1, 2, 3, 9, 4, 5, 6, 7, 9], lo=2, hi=3) == []  # no [7, 9] before
    assert _propose([5, 5, 5, 5]) == [5]  # only the latest occurrence ([5, 5, 5] at 0) has a token after it


def test_a_match_with_k_tokens_after_it_is_preferred_to_a_later_one():
    tokens = [7, 1, 2, 3, 4, 7, 5, 7]
    assert _propose(tokens, k=3, lo=1, hi=1) == [1, 2, 3]  # the 7 at 5 has one token after it, the 7 at 0 four
    assert _propose(tokens, k=3, lo=1, hi=1, max_drafts=1) == [5]  # one draft: the latest 7 has enough


def test_the_cap_and_short_sequences():
    assert _propose([1, 2, 3, 1, 2], k=3, max_drafts=0) == []
    assert _propose([1, 2, 3, 1, 2], k=3, max_drafts=2) == [3, 1]
    assert _propose([1], k=3) == []
    assert _propose([4, 4], k=3, lo=2, hi=2) == []  # [4, 4] is the whole sequence: nothing earlier


def test_byte_matches_across_token_boundaries_do_not_count():
    # as int32 bytes, 256 is 00 01 00 00: [256, 0] contains token 1's bytes at byte offset 1
    assert _propose([256, 0, 7, 1], lo=1, hi=1) == []
    assert _propose([256, 0, 1, 9, 7, 1], lo=1, hi=1) == [9, 7, 1]


def test_the_buffer_grows_with_the_tokens():
    proposer, buffer = NgramProposer(SpeculativeConfig(2, 1, 2)), bytearray()
    tokens = [3, 4, 5, 6]
    assert proposer.propose(tokens, buffer, 9) == []
    tokens += [3, 4]
    assert proposer.propose(tokens, buffer, 9) == [5, 6]
    assert bytes(buffer) == b"".join(t.to_bytes(4, "little") for t in tokens)


def naive_drafts(tokens: list[int], k: int, lo: int, hi: int, max_drafts: int) -> list[int]:
    """The proposer's rule by list slicing: the longest suffix of ``lo``..``hi`` tokens seen before; of its earlier
    occurrences the latest followed by ``k`` tokens, else the earliest; the tokens after it."""
    k = min(k, max_drafts)
    for n in range(hi, lo - 1, -1):
        if k <= 0 or n >= len(tokens):
            continue
        seen = [s for s in range(len(tokens) - n) if tokens[s : s + n] == tokens[-n:]]
        if seen:
            full = [s for s in seen if s + n + k <= len(tokens)]
            start = (full[-1] if full else seen[0]) + n
            return tokens[start : start + k]
    return []


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 2, 256, -1]), max_size=24), st.integers(1, 5), st.integers(1, 3),
       st.integers(0, 2), st.integers(0, 6), st.integers(0, 24))
def test_the_proposer_follows_its_rule_on_drawn_tokens(tokens, k, lo, extra, max_drafts, known):
    """Small alphabets repeat often; 256 and -1 put other tokens' bytes inside theirs (256 is 00 01 00 00); the
    buffer may already hold a prefix of the tokens (``known`` of them) from an earlier proposal."""
    proposer, buffer = NgramProposer(SpeculativeConfig(k, lo, lo + extra)), bytearray()
    proposer.propose(tokens[: min(known, len(tokens))], buffer, 0)
    assert proposer.propose(tokens, buffer, max_drafts) == naive_drafts(tokens, k, lo, lo + extra, max_drafts)


# ------------------------------------------------------------------ verification in the worker
def test_drafts_are_accepted_while_they_equal_the_sampled_tokens():
    drafted = [DraftedRequest(sample=0, first_row=2, drafts=[5, 6, 7]), DraftedRequest(1, 5, [8, 9])]
    # rows: 0, 1 the usual rows (the last positions), 2-4 request 0's draft positions, 5-6 request 1's
    assert verify_drafts([40, 41, 5, 6, 7, 8, 30], drafted) == {0: [5, 6, 7, 40], 1: [8, 30]}
    assert verify_drafts([40, 41, 9, 6, 7, 9, 9], drafted) == {0: [9], 1: [9]}


def test_the_draft_rows_follow_the_usual_ones():
    # requests a (prefill chunk, no sample), b (drafted, 3 drafts), c (plain decode); tokens: a 4, b 4, c 1
    drafted, extra = plan_drafted(["a", "b", "c"], [1, 2], {"b": [1, 2, 3]}, [0, 4, 8, 9])
    assert drafted == [DraftedRequest(0, 2, [1, 2, 3])] and extra.tolist() == [4, 5, 6]


# ------------------------------------------------------------------ the scheduler's drafted steps
def _scheduler(num_blocks: int = 64, k: int = 3, **fields) -> Scheduler:
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    return Scheduler(EngineConfig.create("m", block_size=4, speculative_config=spec, **fields), num_blocks, 256)


def _decode_one(sched: Scheduler, prompt: list[int], first: int, **params) -> Request:
    params.setdefault("max_tokens", 16)
    request = Request("r", prompt, SamplingParams(**params), [EOS], 0.0)
    sched.add_request(request)
    out = sched.schedule()
    sched.update_from_output(out, protocol.ModelRunnerOutput(out.step_id, ["r"], [[first]]))
    return request


def test_a_drafted_step_schedules_the_drafts_and_keeps_only_the_accepted_ones():
    sched = _scheduler()
    request = _decode_one(sched, [10, 11, 12, 13, 14, 15, 10, 11], 12)  # tokens end ... 10, 11, 12
    out = sched.schedule()
    assert out.spec_token_ids == {"r": [13, 14, 15]} and out.num_scheduled_tokens == {"r": 4}
    assert out.cached_reqs.num_computed_tokens == [8]
    deltas = sched.update_from_output(out, protocol.ModelRunnerOutput(out.step_id, ["r"], [[13, 14, 99]]))
    assert [d.new_token_ids for _, d in deltas] == [[13, 14, 99]]
    assert request.num_computed_tokens == 11 and request.num_tokens == 12  # 12, 13, 14 computed; 15 rejected
    assert len(request.block_hashes) == 2  # blocks 0-1 full of known tokens; block 2 holds 14, 99: not full
    stats = sched.get_stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens,
            stats.spec_decode_accepted_per_pos) == (1, 3, 2, [1, 1, 0])
    assert stats.generation_tokens_total == 4


def test_drafts_stop_at_max_tokens_and_at_a_stop_token():
    sched = _scheduler()
    request = _decode_one(sched, [10, 11, 12, 13, 14, 15, 10, 11], 12, max_tokens=3)
    out = sched.schedule()
    assert out.spec_token_ids == {"r": [13]}  # 1 output so far: one draft and one sampled token reach 3
    sched = _scheduler()
    request = _decode_one(sched, [10, 11, 12, 13, 14, 15, 10, 11], 12, stop_token_ids=[14])
    out = sched.schedule()
    deltas = sched.update_from_output(out, protocol.ModelRunnerOutput(out.step_id, ["r"], [[13, 14, 15, 10]]))
    assert [(d.new_token_ids, d.finish_reason, d.stop_reason) for _, d in deltas] == [([13, 14], "stop", 14)]
    assert request.output_token_ids == [12, 13, 14]


def test_drafts_that_do_not_fit_the_kv_cache_are_dropped_rather_than_preempting():
    sched = _scheduler(num_blocks=4, max_model_len=64)  # 16 slots
    for req_id, prompt in (("r", [10, 11, 12, 13, 14, 15, 10, 11]), ("s", [90, 91])):
        sched.add_request(Request(req_id, prompt, SamplingParams(max_tokens=16), [EOS], 0.0))
    out = sched.schedule()  # r takes blocks 0-1, s block 2
    sched.update_from_output(out, protocol.ModelRunnerOutput(out.step_id, ["r", "s"], [[12], [92]]))
    out = sched.schedule()  # r's token and drafts: positions 8-11, block 3
    assert out.spec_token_ids == {"r": [13, 14, 15]} and out.num_scheduled_tokens == {"r": 4, "s": 1}
    sched.update_from_output(out, protocol.ModelRunnerOutput(out.step_id, ["r", "s"], [[10], [93]]))
    out = sched.schedule()  # r now ends 12, 10: drafts 11, 12, 10 would reach position 12, a fifth block
    assert out.spec_token_ids == {} and out.num_scheduled_tokens == {"r": 1, "s": 1} and not out.preempted_req_ids


def test_the_stats_line_reports_acceptance_over_the_interval():
    from asyncllm.engine.stats_log import StatsLogger
    from asyncllm.outputs import EngineStats

    prev = EngineStats(num_requests_running=1, spec_decode_num_drafts=10, spec_decode_num_draft_tokens=30,
                       spec_decode_num_accepted_tokens=12, spec_decode_accepted_per_pos=[6, 4, 2])
    cur = EngineStats(num_requests_running=1, spec_decode_num_drafts=20, spec_decode_num_draft_tokens=60,
                      spec_decode_num_accepted_tokens=27, spec_decode_accepted_per_pos=[14, 9, 4])
    line = StatsLogger.format_line(prev, cur, 1.0)
    assert line is not None and line.endswith(
        ", SpecDecoding: Mean acceptance length: 2.50, Accepted: 15 tokens, Drafted: 30 tokens, "
        "Draft acceptance rate: 50.0%, Per-position acceptance rate: 0.800, 0.500, 0.200")
    assert "SpecDecoding" not in StatsLogger.format_line(cur, cur, 1.0)
    assert cur.spec_decode_acceptance_rate == 27 / 60
