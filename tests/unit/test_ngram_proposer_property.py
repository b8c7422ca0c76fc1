"""`NgramProposer` driven as the scheduler drives it (hypothesis), against the rule of its docstring on plain lists.

The scheduler keeps one proposer for all requests, gives each drafted request an empty ``draft_buffer`` when it is
added, and at each decode step calls ``propose(request.all_token_ids, request.draft_buffer, room)``
(asyncllm/sched/schedule_each.py); ``all_token_ids`` only grows, by the prompt and then by each step's accepted
drafts plus one sampled token, and a finished request's buffer is dropped with it.

Drawn: k, prompt_lookup_min and prompt_lookup_max; an alphabet of 1 to 4 token ids (small ids, so matches are
common; ids such as 1, 0x100 and 0x1000000 whose little-endian int32 bytes appear inside two neighbours, so byte
matches at offsets that are not whole tokens are common too; and any id up to 2**31 - 1); and operations on 3
request slots: add a request with a drawn prompt (a slot's earlier request, if any, finished: a fresh buffer),
propose with a drawn room (-3 to 8: the budget or max_tokens may leave none), accept a step's outputs (a drawn
number of the last drafts, as the target agreed with them, then one drawn token), or append drawn tokens without a
proposal in between (steps where the request was not drafted: a prefill chunk, no room for drafts).

The model is `ref_drafts` of tests/unit/test_ngram_start_after_property.py (the module's docstring on lists: for
n from prompt_lookup_max down to prompt_lookup_min, the last n tokens looked up earlier, overlapping them or not; for
the first n that occurs, the up to min(k, room) tokens after its latest occurrence followed by that many, else after
its earliest). That file draws tokens growing freely; this one adds the scheduler's own growth (accepted drafts, so
the sequences repeat), requests finished and re-added, ids up to 2**31 - 1, and the bytes-00-or-01 alphabets whose
overlapping off-boundary matches the skip loops of `_find_token_aligned` and `_rfind_token_aligned` must step past
one byte at a time. Held after every proposal: the drafts equal the model's exactly, and the buffer holds exactly
the request's tokens as little-endian int32.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asyncllm.spec.config import SpeculativeConfig
from asyncllm.spec.ngram import NgramProposer
from test_ngram_start_after_property import ref_drafts

SLOTS = 3
ADD, PROPOSE, ACCEPT, APPEND = "add", "propose", "accept", "append"
BINARY_BYTES = [int.from_bytes(bytes((bits >> i) & 1 for i in range(4)), "little") for bits in range(16)]
"""The ids whose int32 bytes are each 00 or 01: side by side they hold one another at byte offsets that are not
whole tokens, often overlapping an aligned occurrence ([0x1000000, 1] is 00 00 00 01 01 00 00 00, holding 0x101,
0x10100 and 0x1010000 at byte offsets 3, 2 and 1)."""
STRADDLED = [[0x1000000, 1, 0x101], [0x1000000, 1, 0x10100], [0x1000000, 1, 0x1010000], [0, 1, 0x100],
             [0x10000, 0, 0], [0x100, 1, 0x1000001]]
"""Alphabets where the third id (or [0, 0]) lies inside the first two side by side, as bytes."""


def int32_bytes(tokens: list[int]) -> bytes:
    return b"".join(token.to_bytes(4, "little", signed=True) for token in tokens)


def run_case(config: tuple[int, int, int], alphabet: list[int], ops: list[tuple[str, int, list[int], int]]) -> None:
    k, lo, hi = config
    proposer = NgramProposer(SpeculativeConfig(k, lo, hi))
    requests: list[tuple[list[int], bytearray]] = [([alphabet[0]], bytearray()) for _ in range(SLOTS)]
    last_drafts: list[list[int]] = [[] for _ in range(SLOTS)]
    for kind, slot, picks, number in ops:
        drawn = [alphabet[pick % len(alphabet)] for pick in picks]
        if kind == ADD:  # a new request in the slot; the one there before finished
            requests[slot], last_drafts[slot] = (drawn or alphabet[:1], bytearray()), []
            continue
        tokens, buffer = requests[slot]
        if kind == PROPOSE:
            drafts = proposer.propose(tokens, buffer, number)
            assert drafts == ref_drafts(tokens, k, lo, hi, number), (tokens, number)
            assert bytes(buffer) == int32_bytes(tokens)
            last_drafts[slot] = drafts
        elif kind == ACCEPT:  # the step verified the last drafts: an agreeing prefix, then the target's own token
            tokens += last_drafts[slot][: max(number, 0)] + drawn[:1]
            last_drafts[slot] = []
        else:  # steps without drafts for it
            tokens += drawn
            last_drafts[slot] = []


configs = st.tuples(st.integers(1, 6), st.integers(1, 4), st.integers(0, 3)).map(lambda c: (c[0], c[1], c[1] + c[2]))
alphabets = st.one_of(st.lists(st.integers(0, 3), min_size=1, max_size=4),
                      st.lists(st.sampled_from(BINARY_BYTES), min_size=2, max_size=3), st.sampled_from(STRADDLED),
                      st.lists(st.one_of(st.integers(0, 3), st.sampled_from(BINARY_BYTES), st.integers(0, 2**31 - 1)),
                               min_size=1, max_size=4))
KINDS = [ADD, PROPOSE, PROPOSE, ACCEPT, ACCEPT, APPEND]
operations = st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, SLOTS - 1), st.lists(st.integers(0, 3),
                                                                                           max_size=10),
                                st.integers(-3, 8)), min_size=10, max_size=50)
EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "300"))


@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow],
          derandomize="PROP_EXAMPLES" not in os.environ)  # fixed draws in CI; PROP_EXAMPLES: random
@given(configs, alphabets, operations)
# the latest byte match of the suffix [0x101] is at byte 11 (inside 0x1000000, 1): skipped for the one at token 0
@example((1, 1, 1), [0x101, 5, 0x1000000, 1, 9], [(ADD, 0, [0, 1, 2, 3, 4, 4, 0], 0), (PROPOSE, 0, [], 1)])
# no occurrence has 4 tokens after it: the earliest, past the byte match at byte 6 (0x10100 inside 0x1000000, 1)
@example((4, 1, 1), [0x1000000, 1, 0x10100, 5], [(ADD, 0, [3, 0, 1, 2, 2], 0), (PROPOSE, 0, [], 8)])
# overlapping byte matches: zeros at bytes 3 and 4 (tokens 0x10000, 0, 0), the whole token the one just after
@example((3, 1, 1), [0x10000, 0], [(ADD, 0, [0, 1, 1], 0), (PROPOSE, 0, [], 8)])
# ... and the rfind's: zeros at bytes 5 and 4 (tokens 5, 0, 0x100, 0), the whole token the one just before
@example((1, 1, 1), [5, 0, 0x100], [(ADD, 0, [0, 1, 2, 1], 0), (PROPOSE, 0, [], 8)])
# drafts accepted, then proposed again from the grown buffer; a second request on the same proposer
@example((2, 1, 2), [3, 4, 5], [(ADD, 0, [0, 1, 2, 0], 0), (PROPOSE, 0, [], 9), (ACCEPT, 0, [2], 2),
                                (ADD, 1, [2, 2, 2], 0), (PROPOSE, 1, [], 9), (PROPOSE, 0, [], 9)])
def test_the_proposer_matches_the_docstring_rule_as_the_scheduler_drives_it(config, alphabet, ops) -> None:
    run_case(config, alphabet, ops)
