"""What the served model does, read from its config on the host: `PoolingModel` (torch-free).

A causal LM generates and embeds; a bare decoder (``LlamaModel`` & co.) embeds
only; a ``*ForSequenceClassification`` checkpoint classifies and scores only (and
``token_classify``); a ``*ForTokenClassification`` encoder serves ``token_classify``
only; a reward model (``convert="reward"``, the Qwen2 reward architectures) serves
``token_classify`` only (`RewardPooling`, asyncllm/engine/reward_pooling.py); a
ColBERT (``HF_ColBERT``, late interaction) ``token_embed`` only.
The processor thread refuses any other request by name before tokenizing it
(`PoolingModel.check`). A classifier's `ClassifierHead` holds what the host
needs to turn its logits into vLLM's outputs: the label names, the activations
and how a pair of texts becomes one prompt (docs/pooling.md).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncllm.errors import InvalidRequestError, NotBuiltError
from asyncllm.models.architectures import (
    CLASSIFICATION_ARCHITECTURES,
    EMBEDDING_ARCHITECTURES,
    ENCODER_ARCHITECTURES,
    LATE_INTERACTION_ARCHITECTURES,
    REWARD_ARCHITECTURES,
    TOKEN_CLASSIFICATION_ARCHITECTURES,
    serves_as_encoder,
)
from asyncllm.models.st_dense import dense_modules, read_st_config, st_modules
from asyncllm.engine.reward_pooling import RewardPooling
from asyncllm.pooling import PoolingParams, token_rows

__all__ = ["ClassifierHead", "Matryoshka", "MatryoshkaRefusal", "PoolingModel", "RewardPooling", "lowercases",
           "lowered",
           "pooling_model_of", "sentence_transformers_config", "sentence_transformers_normalize",
           "sentence_transformers_pooling"]

_ST_POOLING_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                     "pooling_mode_cls_token": "CLS"}

_SCORE_ACTIVATIONS = {"Identity": "identity", "Sigmoid": "classify", "Softmax": "classify"}
"""sentence-transformers' cross-encoder activations (``torch.nn.modules.*`` class names) asyncllm applies."""


@dataclass(frozen=True)
class ClassifierHead:
    """A classification model's labels, activations and pair encoding."""

    labels: tuple[str, ...]
    """``id2label`` in label order (transformers' default names ``LABEL_0``, ...)."""
    classify_activation: str = "classify"
    """For `classify`: ``"classify"`` (softmax over the labels; sigmoid for one label), ``"sigmoid"`` (config
    ``problem_type`` multi_label_classification) or ``"identity"`` (regression), as vLLM."""
    score_activation: str = "classify"
    """For `score`: ``"classify"``, or ``"identity"`` when the sentence-transformers config says Identity."""
    use_sep_token: bool = True
    """A pair is ``tokenizer(text_1, text_2)`` (cross-encoders); False (config ``use_sep_token`` or
    ``use_pad_token`` false, vLLM's "LLM as reranker"): the one text ``text_1 + text_2``."""

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> ClassifierHead:
        id2label = getattr(hf_config, "id2label", None) or {0: "LABEL_0"}
        labels = tuple(str(id2label[i]) for i in sorted(id2label, key=int))
        problem = getattr(hf_config, "problem_type", None)
        classify = {"regression": "identity", "multi_label_classification": "sigmoid"}.get(problem, "classify")
        separate = all(getattr(hf_config, key, True) is not False for key in ("use_sep_token", "use_pad_token"))
        return cls(labels, classify, _score_activation(hf_config), separate)

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    def encode_pair(self, tokenizer: Any, text_1: str, text_2: str, max_length: int | None = None
                    ) -> tuple[list[int], int | None]:
        """The token ids of the pair's one prompt (vLLM's cross-encoder encoding; ``max_length``: cut by the
        tokenizer, ``truncation=True``: the longer text first, special tokens kept) and where the tokenizer's
        ``token_type_ids`` turn 1 (the second text, BERT's segment B; vLLM's ``compressed_token_type_ids``), None
        where they stay 0 (or the tokenizer has none)."""
        cut = {} if max_length is None else {"truncation": True, "max_length": max_length}
        if not self.use_sep_token:
            return list(tokenizer(text_1 + text_2, **cut).input_ids), None
        encoding = tokenizer(text_1, text_2, **cut)
        types = list(encoding.get("token_type_ids") or [])
        return list(encoding.input_ids), types.index(1) if 1 in types else None


def activate(logits: list[float], activation: str) -> list[float]:
    """``"identity"``, ``"sigmoid"`` (each logit) or ``"classify"`` (softmax; sigmoid for a single logit)."""
    if activation == "identity":
        return list(logits)
    if activation == "sigmoid" or len(logits) < 2:
        return [0.5 * (1.0 + math.tanh(x / 2)) for x in logits]  # sigmoid without overflow
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def _score_activation(hf_config: Any) -> str:
    name = (getattr(hf_config, "sentence_transformers", None) or {}).get("activation_fn") \
        or getattr(hf_config, "sbert_ce_default_activation_function", None)
    if name is None:
        return "classify"
    activation = _SCORE_ACTIVATIONS.get(str(name).rsplit(".", 1)[-1])
    if activation is None or not str(name).startswith("torch.nn.modules."):
        raise NotBuiltError("model", name, f"the cross-encoder activation {name} (built: "
                                           f"{', '.join(_SCORE_ACTIVATIONS)})")
    return activation


@dataclass(frozen=True)
class Matryoshka:
    """Which output ``dimensions`` an embedding model serves (vLLM's ``ModelConfig.is_matryoshka``)."""

    name: str
    """The model as its refusals name it (``EngineConfig.model``; the OpenAI server names its served name, as vLLM's
    ``served_model_name``: `MatryoshkaRefusal.naming`)."""
    supported: bool = False
    """The config's ``is_matryoshka`` or ``matryoshka_dimensions``: False refuses any ``dimensions``."""
    dimensions: tuple[int, ...] | None = None
    """The config's ``matryoshka_dimensions``: only these; None: any."""

    @classmethod
    def of(cls, hf_config: Any, name: str) -> Matryoshka:
        """From the config (after ``hf_overrides``), as vLLM reads it."""
        dims = getattr(hf_config, "matryoshka_dimensions", None)
        if dims is not None:  # [] allows no size, as vLLM's
            return cls(name, True, tuple(int(d) for d in dims))
        return cls(name, bool(getattr(hf_config, "is_matryoshka", False)))

    def check(self, dimensions: int) -> None:
        """vLLM's refusals of ``dimensions`` for a model that is not Matryoshka or not at this size
        (`MatryoshkaRefusal`)."""
        if not self.supported:
            raise MatryoshkaRefusal(self.name, None)
        if self.dimensions is not None and dimensions not in self.dimensions:
            raise MatryoshkaRefusal(self.name, self.dimensions)


class MatryoshkaRefusal(InvalidRequestError):
    """A refusal of ``dimensions`` in vLLM's words, naming the model; `naming` is the same refusal naming it as a
    server serves it (its served name, as vLLM's ``served_model_name``), the request not checked again."""

    def __init__(self, name: str, sizes: tuple[int, ...] | None) -> None:
        """``sizes``: the only ``dimensions`` the model serves; None: it serves none (not Matryoshka)."""
        self.sizes = sizes
        if sizes is None:
            super().__init__("dimensions", f'Model "{name}" does not support matryoshka representation, changing '
                                           "output dimensions will lead to poor results.")
        else:
            super().__init__("dimensions", f'Model "{name}" only supports {list(sizes)} matryoshka dimensions, use '
                                           "other output dimensions will lead to poor results.")

    def naming(self, name: str) -> MatryoshkaRefusal:
        return MatryoshkaRefusal(name, self.sizes)


@dataclass(frozen=True)
class PoolingModel:
    """The served architecture and which requests it takes."""

    architecture: str
    generates: bool = True
    """False for a model without an LM head."""
    classifier: ClassifierHead | None = None
    """Set for a ``*ForSequenceClassification`` model (it classifies and scores only)."""
    pooling_type: str = "LAST"
    """How embeddings pool the prompt's hidden states (`asyncllm.pooling.POOLING_TYPES`)."""
    normalize: bool = True
    """Embeddings' ``normalize`` when a request leaves it None (``pooler_config``'s)."""
    matryoshka: Matryoshka | None = None
    """Which ``dimensions`` embeddings may be cut to; None: none (a model not prepared from a config)."""
    do_lower_case: bool = False
    """Lowercase text prompts and score pairs before tokenizing them (the sentence-transformers config's
    ``do_lower_case``, as vLLM)."""
    runner: str = "auto"
    """The engine's resolved ``runner`` (asyncllm/engine/runner.py): generate refuses pooling requests, pooling
    refuses generation; auto takes what the architecture serves."""
    reward: RewardPooling | None = None
    """Set for a reward model (``convert="reward"``): it serves ``token_classify`` only."""

    @property
    def late_interaction(self) -> bool:
        """A ColBERT (`LATE_INTERACTION_ARCHITECTURES`): token embeddings only, scores by their MaxSim."""
        return self.architecture in LATE_INTERACTION_ARCHITECTURES

    @property
    def pooling_tasks(self) -> tuple[str, ...]:
        """vLLM's pooling tasks the model serves, its own first: a reward model's and a token classifier's
        ``("token_classify",)``, another classifier's ``("classify", "score", "token_classify")``, else an embedding
        model's ``("embed", "token_embed")`` (asyncllm's causal LMs embed too; a ColBERT's ``("token_embed",)``)."""
        if self.reward is not None or self.architecture in TOKEN_CLASSIFICATION_ARCHITECTURES:
            return ("token_classify",)
        if self.late_interaction:  # ColBERT: scores by MaxSim of these (asyncllm/engine/scoring.py)
            return ("token_embed",)
        return ("classify", "score", "token_classify") if self.classifier is not None else ("embed", "token_embed")

    def apply(self, pooling: PoolingParams | None) -> PoolingParams | None:
        """An embedding request's params with the model's pooling type and default ``normalize`` filled in; a
        classification request's with the pooling type (an encoder's head reads the CLS row)."""
        if pooling is None:
            return pooling
        if self.reward is not None:  # token_classify only (`check`)
            reward, step = self.reward, self.reward.pooling_type == "STEP"
            return msgspec.structs.replace(
                pooling, pooling_type="STEP", token_type_start=None,  # the worker's reward rows (workers/pooler.py)
                use_activation=reward.use_activation if pooling.use_activation is None else pooling.use_activation,
                step_tag_id=reward.step_tag_id if step and pooling.step_tag_id is None else pooling.step_tag_id,
                returned_token_ids=list(reward.returned_token_ids or ()) or None if step and
                pooling.returned_token_ids is None else pooling.returned_token_ids)
        if pooling.task == "classify":  # token_type_start: set for a score pair only, when it is tokenized
            return msgspec.structs.replace(pooling, pooling_type=self.pooling_type, token_type_start=None)
        if pooling.task == "token_classify":  # the score head on every prompt row
            return msgspec.structs.replace(pooling, pooling_type="ALL", token_type_start=None)
        normalize = self.normalize if pooling.normalize is None else pooling.normalize
        pooling_type = "ALL" if pooling.task == "token_embed" else self.pooling_type  # every prompt row: vLLM's
        return msgspec.structs.replace(pooling, normalize=normalize, pooling_type=pooling_type, token_type_start=None)

    def check(self, pooling: PoolingParams | None) -> None:
        """`InvalidRequestError` unless the model serves this request (``pooling`` None: a generation); a refusal of
        ``dimensions`` is a `MatryoshkaRefusal`."""
        task = "generate" if pooling is None else pooling.task
        arch = self.architecture
        for name in ("step_tag_id", "returned_token_ids"):
            if getattr(pooling, name, None) is not None and (self.reward is None or
                                                             self.reward.pooling_type != "STEP"):
                valid = ["dimensions", "normalize"] if task in ("embed", "token_embed") else ["use_activation"]
                raise InvalidRequestError(name, f"Task {task} only supports {valid} parameters, does not support "
                                                f"[{name!r}] parameters (vLLM's words: {name} is for a reward model "
                                                "with pooler_config pooling_type 'STEP')")
        if self.reward is not None:
            if pooling is not None and self.reward.out_of_range(pooling.returned_token_ids):
                raise InvalidRequestError("returned_token_ids", f"must index the rows' {self.reward.width} columns "
                                                                "(the hidden size; a reward head's outputs), got "
                                                                f"{pooling.returned_token_ids}")
            if task != "token_classify":
                raise InvalidRequestError("prompt" if task == "generate" else "model",
                                          f"this engine serves {arch} as a reward model: it "
                                          f"serves token_classify only, not {task} (encode(prompt, "
                                          "pooling_task='token_classify'), or /pooling)")
            return
        if self.late_interaction and task != "token_embed":
            raise InvalidRequestError("prompt" if task == "generate" else "model",
                                      f"this model ({arch}, a late-interaction model) serves token_embed only, not "
                                      f"{task}: use encode(prompt, pooling_task='token_embed') or /pooling for its "
                                      "token embeddings, score() (/score, /rerank) for MaxSim scores")
        if self.runner == "generate" and task != "generate":
            raise InvalidRequestError("model", f"this engine runs {arch} with runner='generate': it serves generation "
                                               f"only, not {task} requests (start it with runner='pooling' for those)")
        if self.runner == "pooling" and task == "generate" and arch not in (*CLASSIFICATION_ARCHITECTURES,
                                                                            *EMBEDDING_ARCHITECTURES):
            raise InvalidRequestError("prompt", f"this engine runs {arch} with runner='pooling': it serves embeddings "
                                                "only, not generation (start it with runner='generate' or 'auto')")
        if self.classifier is not None:
            if arch in TOKEN_CLASSIFICATION_ARCHITECTURES and task != "token_classify":
                raise InvalidRequestError("prompt" if task == "generate" else "model",
                                          f"this model ({arch}, a token classifier) serves token_classify only, not "
                                          f"{task}: use encode(prompt, pooling_task='token_classify') or /pooling")
            if task not in ("classify", "token_classify"):
                raise InvalidRequestError("prompt" if task == "generate" else "model",
                                          f"this model ({arch}) serves classification and scores only: use "
                                          "classify() or score() (/classify, /score, /rerank)")
        elif task in ("classify", "token_classify"):
            raise InvalidRequestError("model", f"this model ({arch}) has no classification head: {task} needs a "
                                               "*ForSequenceClassification checkpoint")
        elif task == "generate" and not self.generates:
            raise InvalidRequestError("prompt", f"this model ({arch}, no LM head) serves embeddings only: use "
                                                "embed() or /v1/embeddings")
        elif task in ("embed", "token_embed") and pooling.dimensions is not None:
            (self.matryoshka or Matryoshka(arch)).check(pooling.dimensions)

    def token_rows(self, pooling: PoolingParams, flat: list[float], prompt_token_ids: list[int]) -> list[list[float]]:
        """A per-token request's rows from the worker's floats (`pooling` as the request gave it): one per prompt
        token (a reward model's STEP: one per step tag), a classifier's through `classify`'s activation (the
        config's ``problem_type``, else a softmax over the labels, a sigmoid for one: vLLM's ``get_act_fn`` for
        token_classify too) unless ``use_activation`` is False (a reward model's rows come activated from the
        worker)."""
        if self.reward is not None:
            applied = self.apply(pooling)
            assert applied is not None
            return token_rows(flat, self.reward.num_rows(applied, prompt_token_ids))
        rows = token_rows(flat, len(prompt_token_ids))
        if pooling.task != "token_classify" or pooling.use_activation is False:
            return rows
        assert self.classifier is not None, "checked on submit"
        return [activate(row, self.classifier.classify_activation) for row in rows]

    def encode_pair(self, tokenizer: Any, text_1: str, text_2: str, max_length: int | None = None
                    ) -> tuple[list[int], int | None]:
        """`ClassifierHead.encode_pair`; `InvalidRequestError` for a model without a classifier."""
        if self.classifier is None:
            raise InvalidRequestError("text_2", f"this model ({self.architecture}) has no classification head to "
                                                "score a pair as one prompt")
        return self.classifier.encode_pair(tokenizer, text_1, text_2, max_length)


def lowercases(model: PoolingModel | None) -> bool:
    """Whether text is lowercased before it is tokenized (``do_lower_case``, as vLLM): a text prompt, a score pair,
    the text chat messages render to (None: a model not prepared from a config, which does not)."""
    return model is not None and model.do_lower_case


def lowered(model: PoolingModel | None, text: str) -> str:
    """`text` as it is tokenized for `model`: lowercased where it `lowercases`."""
    return text.lower() if lowercases(model) else text


_ST_ENCODER_CONFIGS = ("sentence_bert_config.json", "sentence_roberta_config.json", "sentence_distilbert_config.json",
                      "sentence_camembert_config.json", "sentence_albert_config.json",
                      "sentence_xlm-roberta_config.json", "sentence_xlnet_config.json")
"""The names sentence-transformers saves its Transformer module's config under (vLLM's list)."""


def sentence_transformers_config(path: str | None) -> dict[str, Any]:
    """The folder's sentence-transformers encoder config (``max_seq_length``, ``do_lower_case``: vLLM's
    ``encoder_config``), {} without one."""
    for name in _ST_ENCODER_CONFIGS if path is not None else ():
        if os.path.isfile(os.path.join(path, name)):
            return read_st_config(os.path.join(path, name), dict)
    return {}


def _st_module(modules: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    return next((m for m in modules if str(m.get("type", "")).endswith(f".{kind}")), None)


def sentence_transformers_normalize(path: str | None) -> bool:
    """Embeddings' default ``normalize`` (vLLM's): with a ``modules.json`` that lists a Pooling module, whether it
    lists a Normalize module too; else True."""
    modules = st_modules(path)
    if modules is None or _st_module(modules, "Pooling") is None:
        return True
    return _st_module(modules, "Normalize") is not None


def sentence_transformers_pooling(path: str | None) -> str | None:
    """The pooling type the checkpoint folder's sentence-transformers config declares (``modules.json``'s
    Pooling module's ``config.json``), None without one; `NotBuiltError` for a mode asyncllm does not pool."""
    module = _st_module(st_modules(path) or [], "Pooling")
    if module is None:
        return None
    config_path = os.path.join(path or "", module.get("path", ""), "config.json")
    if not os.path.isfile(config_path):
        return None
    config = read_st_config(config_path, dict)
    on = [key for key, value in config.items() if key.startswith("pooling_mode_") and value]
    if len(on) > 1 or any(key not in _ST_POOLING_MODES for key in on):
        raise NotBuiltError("model", ", ".join(on), f"the sentence-transformers pooling {', '.join(on)} "
                            f"(built: one of {', '.join(_ST_POOLING_MODES)})")
    return _ST_POOLING_MODES[on[0]] if on else None


def pooling_model_of(architecture: str, hf_config: Any, path: str | None = None,
                     pooler_config: dict[str, Any] | None = None, matryoshka: Matryoshka | None = None,
                     runner: str = "auto", convert: str = "auto") -> PoolingModel:
    """What ``architecture`` serves; a classifier's head from its config (`NotBuiltError` for an activation
    asyncllm does not apply); embeddings' pooling from ``pooler_config``, else the checkpoint folder's
    sentence-transformers config, else LAST (a causal LM's: vLLM's as_embedding_model's LAST, normalized); `runner`:
    the engine's resolved runner; `convert` its resolved convert (reward: a `RewardPooling`)."""
    pooler = pooler_config or {}
    if convert == "reward" or architecture in REWARD_ARCHITECTURES:  # runner.py refuses it on the others
        return PoolingModel(architecture, False, None, "ALL", False, None,
                            bool(sentence_transformers_config(path).get("do_lower_case", False)), runner,
                            RewardPooling.of(architecture, pooler, getattr(hf_config, "hidden_size", None)))
    normalize = pooler.get("normalize")
    normalize = sentence_transformers_normalize(path) if normalize is None else bool(normalize)
    lower = bool(sentence_transformers_config(path).get("do_lower_case", False))
    if architecture in CLASSIFICATION_ARCHITECTURES:
        own = "LAST"  # where the head reads: a decoder's last row, an encoder's CLS row (or ModernBERT's mean)
        if architecture in TOKEN_CLASSIFICATION_ARCHITECTURES:  # every row (vLLM's tok_pooling_type ALL)
            own = "ALL"
        elif architecture in ENCODER_ARCHITECTURES:
            own = "MEAN" if getattr(hf_config, "classifier_pooling", "cls") == "mean" else "CLS"
        if pooler.get("pooling_type", own) != own:
            raise NotBuiltError("pooler_config", pooler_config, f"{architecture} pooling other than {own}")
        return PoolingModel(architecture, False, ClassifierHead.from_hf_config(hf_config), own,
                            do_lower_case=lower, runner=runner)
    default = "CLS" if serves_as_encoder(architecture, hf_config) else "LAST"  # vLLM's defaults for each
    pooling_type = pooler.get("pooling_type") or sentence_transformers_pooling(path) or default
    dense_modules(path)  # its Dense modules readable, their activations built (the workers apply them)
    return PoolingModel(architecture, architecture not in EMBEDDING_ARCHITECTURES and runner != "pooling", None,
                        pooling_type, normalize, matryoshka, lower, runner)
