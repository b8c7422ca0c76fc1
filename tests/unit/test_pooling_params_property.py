"""Property test: `PoolingParams` from the caller to the engine core, as the host admits it (no engine started).

The host path of an `embed` / `encode` / `reward` request: `embed` refuses ``task="token_embed"`` (field
``pooling_params``), `encode_params` sets ``pooling_task`` as the task; `RequestOptions.validate` runs
`PoolingParams.validate()`; the processor runs the model's `PoolingModel.check`, `PoolingModel.apply` (the model's
pooling type and defaults) and `validate(hidden_size)`; the params then cross the msgspec wire and the core validates
them again. Every bad field must come back as an `InvalidRequestError` whose `.field` names it, never another
exception and never silently accepted; good params come back with only the documented normalizations
(docs/embeddings.md, docs/pooling.md): ``normalize`` None as the model's default (embeddings), ``pooling_type`` the
model's (LAST / MEAN / CLS), ALL for the per-token tasks, STEP on a reward model, ``token_type_start`` None, and on a
reward model ``use_activation``, ``step_tag_id``, ``returned_token_ids`` left None as its ``pooler_config``'s.

Drawn: a subset of fields, each valid or from a pool of wrong values (bools for ints and ints for bools, floats,
numpy scalars, strings, bounds and their neighbours: 0 and 1 for ``dimensions``, the hidden size and one past it,
listed Matryoshka sizes and their neighbours), the route (`embed`, or `encode` with a drawn ``pooling_task``), and a
model (causal LM, bare decoder, classifier, token classifier, ColBERT, reward model with ALL or STEP pooling; hidden
size; not Matryoshka, any size, or listed sizes). A plain reference written from the docs says "admitted, as X" or
"refused, naming one of these fields"; the model's checks run only on params `validate()` passed, so their fields
count only then. Admitted params must apply and validate again unchanged and survive the msgspec wire.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import msgspec
import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from drawn_fields import admitted, drawn_fields

from asyncllm import InvalidRequestError
from asyncllm.engine.pooling_model import ClassifierHead, Matryoshka, PoolingModel, RewardPooling
from asyncllm.pooling import PoolingParams, encode_params

EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "1000"))
TASKS = ("embed", "classify", "token_embed", "token_classify")
PER_TOKEN = ("token_embed", "token_classify")
KINDS = ("lm", "bare", "classifier", "token_classifier", "colbert", "reward")
ARCHITECTURES = {"lm": "LlamaForCausalLM", "bare": "LlamaModel", "classifier": "Qwen3ForSequenceClassification",
                 "token_classifier": "BertForTokenClassification", "colbert": "HF_ColBERT",
                 "reward": "LlamaForCausalLM"}


# ---------------------------------------------------------------- the reference, from docs/pooling.md
def is_int(v: Any) -> bool:
    """A Python int, not a bool (numpy's ints are refused: config_checks.is_int)."""
    return isinstance(v, int) and not isinstance(v, bool)


def token_id(v: Any) -> bool:
    """An id the wire carries: a Python int from 0 below 2**63 (msgpack's int64)."""
    return is_int(v) and 0 <= v < 2**63


def ok_ids(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and bool(v) and all(token_id(i) for i in v)


def field_errors(f: dict[str, Any]) -> set[str]:
    """The fields `validate()` refuses whatever the model: types, and fields for another task."""
    task, bad = f["task"], set()
    if f["normalize"] is not None and (not isinstance(f["normalize"], bool) or task == "token_classify"):
        bad.add("normalize")
    kind = f["pooling_type"]
    if kind not in ("LAST", "MEAN", "CLS") and not (kind == "ALL" and task in PER_TOKEN) \
            and not (kind == "STEP" and task == "token_classify"):
        bad.add("pooling_type")
    if type(task) is not str or task not in TASKS:  # numpy's str_ equals a task but cannot cross the wire
        bad.add("task")
    if f["dimensions"] is not None and (task in ("classify", "token_classify") or not is_int(f["dimensions"])
                                        or f["dimensions"] < 1):
        bad.add("dimensions")
    if f["use_activation"] is not None and (task != "token_classify" or not isinstance(f["use_activation"], bool)):
        bad.add("use_activation")
    for name, good in (("step_tag_id", token_id), ("returned_token_ids", ok_ids)):
        if f[name] is not None and (task != "token_classify" or not good(f[name])):
            bad.add(name)
    return bad


def model_errors(f: dict[str, Any], model: dict[str, Any]) -> set[str]:
    """The fields `PoolingModel.check` and `validate(hidden_size)` refuse for params `validate()` passed."""
    kind, task, reward = model["kind"], f["task"], model["reward"]
    step = reward is not None and reward.pooling_type == "STEP"
    bad = {n for n in ("step_tag_id", "returned_token_ids") if f[n] is not None and not step}
    if kind == "reward":
        if f["returned_token_ids"] is not None and max(f["returned_token_ids"]) >= model["hidden_size"]:
            bad.add("returned_token_ids")
        return bad | ({"model"} if task != "token_classify" else set())
    serves = {"lm": ("embed", "token_embed"), "bare": ("embed", "token_embed"), "colbert": ("token_embed",),
              "classifier": ("classify", "token_classify"), "token_classifier": ("token_classify",)}[kind]
    if task not in serves or model["runner"] == "generate":
        bad.add("model")
    dims = f["dimensions"]
    if dims is not None and task in ("embed", "token_embed"):
        sizes = model["matryoshka"]
        if sizes is False or sizes is not True and dims not in sizes or dims > model["hidden_size"]:
            bad.add("dimensions")
    return bad


def applied(f: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
    """The params the core gets: the documented normalizations (`PoolingModel.apply`)."""
    out, reward = dict(f, token_type_start=None), model["reward"]
    if reward is not None:
        step = reward.pooling_type == "STEP"
        out["pooling_type"] = "STEP"
        out["use_activation"] = reward.use_activation if f["use_activation"] is None else f["use_activation"]
        if step and f["step_tag_id"] is None:
            out["step_tag_id"] = reward.step_tag_id
        if step and f["returned_token_ids"] is None:
            out["returned_token_ids"] = list(reward.returned_token_ids or ()) or None
    elif f["task"] == "classify":
        out["pooling_type"] = model["pooling_type"]
    elif f["task"] in PER_TOKEN:
        out["pooling_type"] = "ALL"
    else:
        out["pooling_type"] = model["pooling_type"]
    if reward is None and f["task"] in ("embed", "token_embed") and f["normalize"] is None:
        out["normalize"] = model["normalize"]
    return out


def reference(fields: dict[str, Any], route: tuple[str, Any], model: dict[str, Any]):
    """(the core's fields, None) for admitted params, else (None, the fields the error may name)."""
    f = {name: getattr(PoolingParams(), name) for name in PoolingParams.__struct_fields__} | fields
    way, pooling_task = route
    if way == "encode":
        if pooling_task not in ("embed", "token_embed", "token_classify"):
            return None, {"pooling_task"}
        f["task"] = pooling_task
    elif f["task"] == "token_embed":
        return None, {"pooling_params"}
    for stage in (field_errors, lambda x: model_errors(x, model)):
        bad = stage(f)
        if bad:
            return None, bad
    return applied(f, model), None


# ---------------------------------------------------------------- the module: caller to core
def pooling_model(model: dict[str, Any]) -> PoolingModel:
    kind, sizes = model["kind"], model["matryoshka"]
    matryoshka = Matryoshka("m", sizes is not False, None if isinstance(sizes, bool) else tuple(sizes))
    head = ClassifierHead(("LABEL_0", "LABEL_1")) if "classifier" in kind else None
    return PoolingModel(ARCHITECTURES[kind], kind == "lm", head, model["pooling_type"], model["normalize"],
                        matryoshka, runner=model["runner"], reward=model["reward"])


def admit(fields: dict[str, Any], route: tuple[str, Any], model: dict[str, Any]) -> PoolingParams:
    """What the host does with a request's params before the core: engine_requests, stream, processor_requests."""
    params = PoolingParams(**fields)
    way, pooling_task = route
    if way == "encode":
        params = encode_params(pooling_task, params)
    elif params.task == "token_embed":  # AsyncEngine.embed
        raise InvalidRequestError("pooling_params", "token_embed: use encode")
    params.validate()  # RequestOptions.validate
    served = pooling_model(model)
    served.check(params)
    params = served.apply(params)
    params.validate(model["hidden_size"])
    return params


def wire(params: PoolingParams) -> PoolingParams:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=PoolingParams)


def same(a: Any, b: Any) -> bool:
    """Equal, and of the same types all the way down (1 is not 1.0 nor True; (1,) is not [1])."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    return a == b


# ---------------------------------------------------------------- strategies
HIDDEN = (1, 8, 64)
MATRYOSHKA_SIZES = ([], [4], [8, 16], [1, 64, 65])
INT_WRONG = [True, False, 1.0, 8.0, "8", np.int64(8), np.int32(4), -1, [8], 2.5]
BOOL_WRONG = [1, 0, "true", np.bool_(True), 1.0]
ids = st.one_of(st.integers(0, 70), st.sampled_from([-1, 2**31, 2**63 - 1, 2**63, 2**64, True, 1.0, np.int64(3), "1"]))
FIELDS: dict[str, st.SearchStrategy] = {
    "normalize": st.sampled_from([None, True, False, *BOOL_WRONG]),
    "dimensions": st.one_of(st.none(), st.sampled_from([0, 1, 4, 7, 8, 9, 16, 63, 64, 65, 66]), st.integers(-2, 70),
                            st.sampled_from(INT_WRONG)),
    "task": st.sampled_from([*TASKS, "score", "generate", "Embed", "", None, 5, ["embed"], np.str_("embed")]),
    "pooling_type": st.sampled_from(["LAST", "MEAN", "CLS", "ALL", "STEP", "last", "", None, 0]),
    "token_type_start": st.sampled_from([None, 0, 3, -1, "x", 1.5]),
    "use_activation": st.sampled_from([None, True, False, *BOOL_WRONG]),
    "step_tag_id": st.one_of(st.none(), ids),
    "returned_token_ids": st.one_of(st.none(), st.lists(ids, max_size=3), st.lists(ids, max_size=3).map(tuple),
                                    st.sampled_from([3, "0", {0: 1}, [[0]]])),
}
VALID: dict[str, st.SearchStrategy] = {
    "normalize": st.sampled_from([None, True, False]), "dimensions": st.sampled_from([None, 1, 4, 8, 16, 64]),
    "task": st.sampled_from(TASKS), "pooling_type": st.sampled_from(["LAST", "MEAN", "CLS"]),
    "token_type_start": st.sampled_from([None, 0, 3]), "use_activation": st.sampled_from([None, True, False]),
    "step_tag_id": st.none() | st.integers(0, 70),
    "returned_token_ids": st.none() | st.lists(st.integers(0, 70), min_size=1, max_size=3),
}
routes = st.one_of(st.just(("embed", None)), st.tuples(st.just("encode"), st.sampled_from(
    ["embed", "token_embed", "token_classify", "classify", "score", None, "reward"])))
SERVED_ROUTES = {"lm": [("embed", None), ("encode", "embed"), ("encode", "token_embed")],
                 "bare": [("embed", None), ("encode", "token_embed")], "colbert": [("encode", "token_embed")],
                 "classifier": [("embed", None), ("encode", "token_classify")],
                 "token_classifier": [("encode", "token_classify")], "reward": [("encode", "token_classify")]}
"""Routes the model serves (`embed` with the task ``classify`` for a classifier: what `classify` sends)."""


requests = functools.partial(drawn_fields, FIELDS, VALID, 0, 4)
"""One field from its whole pool and a few others valid, or several from their whole pools."""


@st.composite
def models(draw: st.DrawFn) -> dict[str, Any]:
    """A served model's capabilities: kind, hidden size, Matryoshka sizes, pooling, a reward model's pooler_config."""
    kind, hidden = draw(st.sampled_from((*KINDS, "reward"))), draw(st.sampled_from(HIDDEN))  # reward: most fields
    reward = None
    if kind == "reward":
        step = draw(st.booleans())
        reward = RewardPooling("STEP" if step else "ALL", draw(st.none() | st.integers(0, 9)) if step else None,
                               draw(st.none() | st.lists(st.integers(0, hidden - 1), min_size=1, max_size=2)
                                    .map(tuple)) if step else None, draw(st.booleans()), hidden)
    return {"kind": kind, "hidden_size": hidden, "reward": reward,
            "matryoshka": draw(st.sampled_from([False, True, *MATRYOSHKA_SIZES])),
            "pooling_type": draw(st.sampled_from(["LAST", "MEAN", "CLS"])), "normalize": draw(st.booleans()),
            "runner": "generate" if kind == "lm" and draw(st.integers(0, 5)) == 0 else "auto"}


@st.composite
def cases(draw: st.DrawFn) -> tuple[dict[str, Any], tuple[str, Any], dict[str, Any]]:
    """A request, its route and the model; mostly a route the model serves, so that the fields decide."""
    model = draw(models())
    served = draw(st.integers(0, 3)) > 0
    route = draw(st.sampled_from(SERVED_ROUTES[model["kind"]]) if served else routes)
    fields = draw(requests())
    if served and route == ("embed", None) and "task" not in fields:
        fields["task"] = "classify" if model["kind"] == "classifier" else "embed"
    return fields, route, model


def lm(matryoshka: Any = True, hidden: int = 64, **extra: Any) -> dict[str, Any]:
    """A causal LM embedding model (for the examples)."""
    return {"kind": "lm", "hidden_size": hidden, "reward": None, "matryoshka": matryoshka, "pooling_type": "LAST",
            "normalize": True, "runner": "auto", **extra}


def rm(reward: RewardPooling) -> dict[str, Any]:
    return lm(False, 8, kind="reward", reward=reward)


EMBED = ("embed", None)
REWARD = ("encode", "token_classify")


# ---------------------------------------------------------------- the property
@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow],
          derandomize="PROP_EXAMPLES" not in os.environ)  # fixed draws in CI; PROP_EXAMPLES: random
@given(cases())
@example(({"dimensions": True}, EMBED, lm()))  # a bool is not a size
@example(({"dimensions": np.int64(8)}, EMBED, lm()))  # numpy's ints are refused (they cannot cross the wire)
@example(({"dimensions": 64}, EMBED, lm()))  # the hidden size itself
@example(({"dimensions": 65}, EMBED, lm()))
@example(({"dimensions": 0}, EMBED, lm()))
@example(({"dimensions": 8}, EMBED, lm(False)))  # not Matryoshka: vLLM's refusal
@example(({"dimensions": 16}, EMBED, lm([8, 16])))
@example(({"dimensions": 9}, EMBED, lm([8, 16])))
@example(({"dimensions": 8}, EMBED, lm([])))  # [] allows no size
@example(({"dimensions": 65}, EMBED, lm([1, 64, 65])))  # listed, but past the hidden size
@example(({"dimensions": 8, "normalize": False}, ("encode", "token_embed"), lm()))
@example(({"task": "token_embed"}, EMBED, lm()))  # embed() points at encode
@example(({"normalize": 1}, EMBED, lm()))
@example(({"normalize": np.bool_(True)}, EMBED, lm()))
@example(({"use_activation": False}, EMBED, lm()))  # token_classify only
@example(({"use_activation": False}, REWARD, lm(kind="classifier")))
@example(({"use_activation": 0}, REWARD, lm(kind="classifier")))
@example(({"normalize": True}, REWARD, lm(kind="classifier")))
@example(({"dimensions": 8}, REWARD, lm(kind="classifier")))
@example(({"task": "classify", "dimensions": 8}, EMBED, lm(kind="classifier")))
@example(({"task": "classify"}, EMBED, lm()))  # no score head
@example(({"pooling_type": "ALL"}, EMBED, lm()))  # ALL is the per-token tasks'
@example(({"pooling_type": "ALL"}, ("encode", "token_embed"), lm()))
@example(({"pooling_type": "STEP"}, REWARD, rm(RewardPooling("ALL", width=8))))
@example(({}, ("encode", "classify"), lm()))
@example(({}, ("encode", None), lm()))
@example(({}, REWARD, rm(RewardPooling("STEP", 5, (0, 1), False, 8))))  # the pooler_config's fill the request's
@example(({"step_tag_id": 3, "returned_token_ids": [7]}, REWARD, rm(RewardPooling("STEP", 5, (0, 1), True, 8))))
@example(({"returned_token_ids": [8]}, REWARD, rm(RewardPooling("STEP", width=8))))  # past the rows' width
@example(({"returned_token_ids": (1, 2)}, REWARD, rm(RewardPooling("STEP", width=8))))
@example(({"step_tag_id": 2**64}, REWARD, rm(RewardPooling("STEP", width=8))))  # past int64: was an OverflowError
@example(({"task": np.str_("embed")}, EMBED, lm()))  # numpy's str: was a TypeError on the wire
@example(({"returned_token_ids": []}, REWARD, rm(RewardPooling("STEP", width=8))))
@example(({"step_tag_id": 3}, REWARD, rm(RewardPooling("ALL", width=8))))  # STEP models only
@example(({"step_tag_id": 3}, REWARD, lm(kind="classifier")))
@example(({"returned_token_ids": [True]}, REWARD, rm(RewardPooling("STEP", width=8))))
@example(({"returned_token_ids": {0: 1}}, REWARD, rm(RewardPooling("STEP", width=8))))
@example(({"use_activation": False}, REWARD, rm(RewardPooling("STEP", use_activation=True, width=8))))
@example(({"step_tag_id": 3}, ("encode", "token_embed"), rm(RewardPooling("STEP", width=8))))  # token_classify's
@example(({"task": "score"}, EMBED, lm()))  # score() sends classify
@example(({"task": "classify", "token_type_start": 3}, EMBED, lm(kind="classifier")))  # set for a score pair only
@example(({"pooling_type": "STEP"}, EMBED, lm()))  # STEP is a reward model's token_classify's
@example(({"step_tag_id": True}, REWARD, rm(RewardPooling("STEP", width=8))))
@example(({"step_tag_id": -1}, REWARD, rm(RewardPooling("STEP", width=8))))
@example(({}, EMBED, rm(RewardPooling("STEP", width=8))))  # a reward model serves token_classify only
@example(({}, ("encode", "token_embed"), lm(kind="colbert")))
@example(({}, EMBED, lm(kind="colbert")))
@example(({}, EMBED, lm(runner="generate")))
@example(({"token_type_start": "x"}, EMBED, lm()))  # the engine's field: overwritten, never read from the caller
def test_admission_matches_the_reference(case: tuple[dict[str, Any], tuple[str, Any], dict[str, Any]]) -> None:
    fields, route, model = case
    expected, may_name = reference(fields, route, model)
    params = admitted(lambda: admit(fields, route, model), expected, may_name, same)
    if params is None:
        return
    served = pooling_model(model)
    served.check(params)  # admitted params are admitted again, unchanged
    assert served.apply(params) == params
    params.validate(model["hidden_size"])
    core = wire(params)
    core.validate()  # the core's check_add_request
    ids = params.returned_token_ids  # a tuple crosses as a list (msgpack has one array type)
    assert core == msgspec.structs.replace(params, returned_token_ids=None if ids is None else list(ids))
