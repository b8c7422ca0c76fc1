"""The host's check of each request's LoRA adapter against the served model (torch-free).

`AdapterChecker` reads the adapter folder once per id (`read_adapter`, asyncllm/lora.py) and checks every
tensor's name and shape against the model's adaptable projections (`module_shapes`, `layer_module_shapes`), so
a bad adapter is the request's `InvalidRequestError`, never a worker's failure. Past `kept_lora_ids` ids, the least
recently used ones no request runs with are forgotten (`AdapterChecker.forget_idle`), here and in the core. A new
id's check (a hub lookup or download, the folder read, the NaN scan) runs on a thread of its own, once for every
request waiting on it (`AdapterChecker.checking`): the processor thread parks those requests meanwhile
(asyncllm/engine/processor_lora.py). docs/lora.md has the whole story.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Any, Callable, Container

import msgspec

from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.lora import (_FIELD, _TENSOR_NAME, KEPT_LORA_IDS, Adapter, AdapterModule, IdleIds, LoRARequest, _fail,
                           check_finite, read_adapter)
from asyncllm.lora_experts import ExpertLayer, expert_problem, is_expert_path
from asyncllm.lora_hybrid_shapes import kimi_linear_shapes, minimax_shapes, state_space_shapes, zamba2_shapes
from asyncllm.models.architectures import base_architecture
from asyncllm.models.family_config import kv_heads, latent_attention_shapes, mlp_width

__all__ = ["AdapterChecker", "module_shapes", "layer_module_shapes"]

FUSED_LORA_ARCHITECTURES = ("Phi3ForCausalLM", "GPTNeoXForCausalLM", "GPT2LMHeadModel", "GPTBigCodeForCausalLM",
                            "FalconForCausalLM", "DbrxForCausalLM", "BloomForCausalLM", "MptForCausalLM",
                            "Phi4MultimodalForCausalLM")  # Phi-3's decoder
"""Architectures whose checkpoints, and so whose adapters, hold q/k/v and gate/up fused."""
FUSED_MLP_LORA_ARCHITECTURES = ("GlmForCausalLM", "Glm4ForCausalLM", "glm4v_text")
"""Architectures (or, for a decoder inside an image-text checkpoint, its text config's model_type: GLM-4.1V's)
whose checkpoints hold gate/up fused (``gate_up_proj``) and q, k, v apart (GLM, GLM-4)."""


GATED_ATTENTION_TYPES = frozenset({"afmoe"})
"""Model types whose attention has its own ``self_attn.gate_proj`` (an output gate), beside the MLP's."""


def module_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(input features, output features) of every adaptable projection of the model, by projection name
    (the checkpoint's names: fused ``qkv_proj`` and ``gate_up_proj`` for `FUSED_LORA_ARCHITECTURES`, ``gate_up_proj``
    for `FUSED_MLP_LORA_ARCHITECTURES`); a block's own projection of a name another block uses too, by
    ``block.name`` (``self_attn.gate_proj``)."""
    state_space = state_space_shapes(hf_config)
    if state_space is not None:  # Mamba's mixers (no attention, no MLP)
        return state_space
    hidden = hf_config.hidden_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q = hf_config.num_attention_heads * head_dim
    kv, inter = kv_heads(hf_config) * head_dim, mlp_width(hf_config)  # under each family's config fields
    shared = {"o_proj": (q, hidden), "down_proj": (inter, hidden), "c_fc": (hidden, inter), "c_proj": (inter, hidden)}
    arch = _architecture(hf_config)
    if arch in FUSED_LORA_ARCHITECTURES:
        return {"qkv_proj": (hidden, q + 2 * kv), "gate_up_proj": (hidden, 2 * inter), **shared}
    fused_mlp = {arch, getattr(hf_config, "model_type", None)} & set(FUSED_MLP_LORA_ARCHITECTURES)
    mlp = ({"gate_up_proj": (hidden, 2 * inter)} if fused_mlp else {"gate_proj": (hidden, inter), "up_proj": (hidden, inter)})
    if hasattr(hf_config, "kv_lora_rank"):  # latent attention (DeepSeek): its own projections
        return {**mlp, **shared, **latent_attention_shapes(hf_config)}
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), **mlp, **shared}
    if getattr(hf_config, "model_type", None) in GATED_ATTENTION_TYPES:  # the attention's own output gate
        shapes["self_attn.gate_proj"] = (hidden, q)
    return {**shapes, **_linear_attention_shapes(hf_config, hidden, q)} if hasattr(hf_config, "linear_num_key_heads") \
        else shapes


_HYBRID_LAYER_SHAPES = {"kimi_linear": kimi_linear_shapes, "zamba2": zamba2_shapes, "minimax": minimax_shapes}


def layer_module_shapes(hf_config: Any) -> list[dict[str, tuple[int, int]]] | None:
    """Each layer's adaptable projections where the layers differ (Gemma 4: head sizes, KV sharing, values that are
    keys, double-wide MLPs; Gemma 3n: KV sharing, MLP widths per layer; Kimi-Linear: KDA or latent attention, dense
    MLP or experts; Zamba2: shared-block invocations or Mamba2 layers: asyncllm/lora_hybrid_shapes.py); None where
    `module_shapes` holds for every layer."""
    hybrid = _HYBRID_LAYER_SHAPES.get(getattr(hf_config, "model_type", None))
    if hybrid is not None:
        return hybrid(hf_config)
    if getattr(hf_config, "model_type", None) not in ("gemma4_text", "gemma3n_text"):
        return None
    from asyncllm.models.gemma4_config import projection_shapes  # no torch

    return projection_shapes(hf_config)


def _linear_attention_shapes(hf_config: Any, hidden: int, q: int) -> dict[str, tuple[int, int]]:
    """Qwen3.5's: the gated attention's ``q_proj`` (queries and their gates), the Gated DeltaNet's projections."""
    key = hf_config.linear_num_key_heads * hf_config.linear_key_head_dim
    value = hf_config.linear_num_value_heads * hf_config.linear_value_head_dim
    heads = hf_config.linear_num_value_heads
    return {"q_proj": (hidden, 2 * q), "in_proj_qkv": (hidden, 2 * key + value), "in_proj_z": (hidden, value),
            "in_proj_b": (hidden, heads), "in_proj_a": (hidden, heads), "out_proj": (value, hidden)}


def _architecture(hf_config: Any) -> str | None:
    architectures = getattr(hf_config, "architectures", None) or []
    return base_architecture(architectures[0]) if architectures else None


class AdapterChecker:
    """The host's check of each request's adapter, once per adapter id (thread-safe; `checking`: off the caller's
    thread, one check per id at a time)."""

    def __init__(self, hf_text_config: Any, max_lora_rank: int, experts: list[ExpertLayer | None] | None = None,
                 adaptable_experts: bool = False, transposed_experts: bool = False, runs_tower: bool = False,
                 kept_ids: int = KEPT_LORA_IDS) -> None:
        self.max_lora_rank = max_lora_rank
        self._idle = IdleIds(kept_ids)
        """Which ids no request runs with stay checked (`forget_idle`; `kept_lora_ids`)."""
        self._runs_tower = runs_tower
        """An image-text model that runs its ``vision_tower`` (LFM2-VL): an adapter of it is refused, not left out."""
        self._experts = experts
        """A mixture of experts' layers (None: a dense layer); None for a dense model."""
        self._adaptable_experts = adaptable_experts
        """Whether the model's experts take adapters (asyncllm/lora_experts.py; the attention's always do)."""
        self._transposed_experts = transposed_experts
        """PEFT stores the model's stacked-expert adapters with A and B in each other's places (Llama 4)."""
        self._hidden = hf_text_config.hidden_size
        self._num_layers = hf_text_config.num_hidden_layers
        self._shapes = module_shapes(hf_text_config)
        self._layer_shapes = layer_module_shapes(hf_text_config)
        """Each layer's own projections and shapes where layers differ (Gemma 4); None: `_shapes` for all."""
        self._arch = _architecture(hf_text_config) or "this model"
        self._state_space = state_space_shapes(hf_text_config) is not None
        """Mamba's: its mixers' projections (``mixer.``) are the only ones; any other model's ``mixer.`` names left
        (Nemotron-H's Mamba2 mixers: asyncllm/lora_names.py) take none."""
        self._checked: dict[int, tuple[LoRARequest, LoRARequest]] = {}
        """Adapter id -> (the request as given, as checked: ``lora_path`` a local folder), least recently used first."""
        self._flights: dict[int, _Flight] = {}
        """Adapter id -> its latest check in flight (`checking`)."""
        self._lock = threading.Lock()
        self._pinned: set[int] = set()
        """Ids pinned (`AsyncEngine.pin_lora`): never forgotten as idle (their pin would end in the core)."""

    def check(self, request: LoRARequest, checked: LoRARequest | None = None) -> LoRARequest:
        """The request with ``lora_path`` resolved to a local folder; `InvalidRequestError` for a bad adapter.
        `checked`: `checking`'s outcome for this very request, recorded again (nothing read) should its id have been
        forgotten as idle since."""
        request.validate()
        known = self._recall(request.lora_int_id)
        if known is not None:
            return _same_adapter(known, request)
        resolved = checked if checked is not None else self._read(request)
        with self._lock:
            self._checked[request.lora_int_id] = (request, resolved)
        return resolved

    def checking(self, request: LoRARequest) -> concurrent.futures.Future[LoRARequest]:
        """`check` of `request` off the calling thread: the future of its outcome, its error an `InvalidRequestError`.
        Done at once for an id checked already (or a malformed request); else the check runs on a thread of its own
        (a hub lookup or download, the folder read, the NaN scan wait there), one per id at a time: a request naming
        the adapter of the id's check in flight, as given, shares that check and its outcome, its error included; one
        naming it otherwise is checked after it (one id, one adapter). A waiter that gives up never cancels a check:
        it runs on and records its adapter; a failure is not kept (the id used again is checked again). `forget` (the
        id removed) meanwhile: it records nothing, its waiters get an `InvalidRequestError` saying so."""
        try:
            request.validate()
            known = self._recall(request.lora_int_id)
            if known is not None:
                return _settled(_same_adapter(known, request))
        except InvalidRequestError as exc:
            return _settled(error=exc)
        return self._flight(request)

    def _recall(self, lora_int_id: int) -> tuple[LoRARequest, LoRARequest] | None:
        """A checked id's (given, checked) adapter, the most recently used now; None for an unknown id."""
        with self._lock:
            known = self._checked.pop(lora_int_id, None)
            if known is not None:
                self._checked[lora_int_id] = known
        return known

    def _read(self, request: LoRARequest) -> LoRARequest:
        """Resolve the adapter's folder, read it and check it against the model: the request as checked."""
        resolved = msgspec.structs.replace(request, lora_path=_resolve(request.lora_path))
        adapter = read_adapter(resolved.lora_path)
        self._check_adapter(adapter)
        check_finite(adapter)  # once per id, as the rest: a NaN would spread to every request batched with it
        return resolved

    def _flight(self, request: LoRARequest) -> concurrent.futures.Future[LoRARequest]:
        """The check in flight of `request`'s adapter as given, or a new one on a thread of its own (after the id's
        other check in flight, if any)."""
        with self._lock:
            before = self._flights.get(request.lora_int_id)
            if before is not None and before.request == request:
                return before.future
            flight = self._flights[request.lora_int_id] = _Flight(request, before)
        try:
            threading.Thread(target=self._check_off_thread, args=(flight,), name="asyncllm-lora-check",
                             daemon=True).start()
        except RuntimeError:  # no thread at interpreter shutdown: inline
            self._check_off_thread(flight)
        return flight.future

    def _check_off_thread(self, flight: _Flight) -> None:
        """`flight`'s check into its future (after the id's check before it), forgotten as in flight before it is
        set."""
        if flight.before is not None:
            concurrent.futures.wait([flight.before.future])
        try:
            outcome, error = self._check_flight(flight), None
        except BaseException as exc:  # noqa: BLE001 - the waiters' error (never left waiting), not the thread's
            outcome, error = None, _request_error(flight.request, exc)
        with self._lock:
            if self._flights.get(flight.request.lora_int_id) is flight:
                del self._flights[flight.request.lora_int_id]
        if error is not None:
            flight.future.set_exception(error)
        else:
            flight.future.set_result(outcome)

    def _check_flight(self, flight: _Flight) -> LoRARequest:
        """`check` of a flight's request, recorded only if its id was not removed meanwhile (`forget`: remove_lora
        wins over the check it overtook, which resurrects nothing)."""
        request = flight.request
        if not flight.removed:
            known = self._recall(request.lora_int_id)
            if known is not None:  # checked by the id's check before it
                return _same_adapter(known, request)
            resolved = self._read(request)
            with self._lock:
                if not flight.removed:
                    self._checked[request.lora_int_id] = (request, resolved)
                    return resolved
        raise InvalidRequestError(_FIELD, f"lora_int_id {request.lora_int_id} was removed (remove_lora) while its "
                                          f"adapter {request.lora_name!r} was being checked: use it again to check "
                                          "it afresh")

    def ids(self) -> set[int]:
        """The adapter ids checked and not forgotten since."""
        with self._lock:
            return set(self._checked)

    def known(self) -> list[tuple[LoRARequest, LoRARequest]]:
        """Every checked id's (given, checked) adapter, least recently used first (a restarted core binds them)."""
        with self._lock:
            return list(self._checked.values())

    def forget(self, lora_int_id: int) -> bool:
        """`AsyncEngine.remove_lora`: the id names nothing here any more (nor is it pinned), and its checks in flight
        record nothing; whether it named an adapter or was being checked."""
        with self._lock:
            self._pinned.discard(lora_int_id)
            flight = self._flights.pop(lora_int_id, None)
            doomed = flight is not None
            while flight is not None:  # its checks in flight record nothing: their waiters get the removal's error
                flight.removed, flight = True, flight.before
            return self._checked.pop(lora_int_id, None) is not None or doomed

    def given(self, lora_int_id: int) -> LoRARequest | None:
        """The adapter as given for a checked id; None for an unknown one."""
        with self._lock:
            known = self._checked.get(lora_int_id)
        return None if known is None else known[0]

    def pin(self, lora_int_id: int, pinned: bool = True) -> None:
        """`AsyncEngine.pin_lora`: the id is never forgotten as idle (``pinned`` False: it may be again)."""
        with self._lock:
            if pinned:
                self._pinned.add(lora_int_id)
            else:
                self._pinned.discard(lora_int_id)

    def forget_idle(self, in_use: Callable[[], Container[int]]) -> list[int]:
        """Past `kept_ids` checked ids, forget the least recently used ones no request runs with (`in_use`: the ids of
        the requests in flight, never forgotten, nor are the pinned ones; `IdleIds`); the ids forgotten, which the
        caller forgets in the core too. Used again, such an id is checked afresh, and may name another folder.
        Called per request (by the processor thread alone): takes no lock while nothing is due (a request naming no
        adapter)."""
        if self._idle.settled(len(self._checked)):
            return []
        with self._lock:
            forgotten = self._idle.to_forget(self._checked, lambda: {*in_use(), *self._pinned})
            for lora_int_id in forgotten:
                del self._checked[lora_int_id]
        return forgotten

    def _check_adapter(self, adapter: Adapter) -> None:
        if self._runs_tower and adapter.unserved:
            _fail(adapter.path, f"tensor {adapter.unserved[0]}: adapters on the vision tower and projector are not "
                                "built (the decoder's projections only)")
        if adapter.max_rank > self.max_lora_rank:
            _fail(adapter.path, f"its rank {adapter.max_rank} is above max_lora_rank={self.max_lora_rank}: "
                                f"start the engine with max_lora_rank >= {adapter.max_rank}")
        for name, module in adapter.modules.items():
            match = _TENSOR_NAME.fullmatch(f"{name}.lora_A.weight")
            assert match is not None, name
            layer, projection = int(match.group(1)), match.group(3)
            if layer >= self._num_layers:
                _fail(adapter.path, f"{name}: the model has {self._num_layers} layers")
            self._check_block(adapter.path, name, match.group(2))
            if match.group(2) == "mlp" and self._check_experts(adapter.path, name, module, layer, projection):
                continue
            shapes = self._shapes if self._layer_shapes is None else self._layer_shapes[layer]
            expected = shapes.get(f"{match.group(2)}.{projection}", shapes.get(projection))  # block's own first
            if expected is None:
                where = self._arch if self._layer_shapes is None else f"layer {layer} of {self._arch}"
                _fail(adapter.path, f"{name}: {where} has no {projection} to adapt (its projections: "
                                    f"{', '.join(sorted(shapes))}){_fused_hint(projection)}")
            if (module.in_features, module.out_features) != expected:
                _fail(adapter.path, f"{name} maps {module.in_features} -> {module.out_features} features, this "
                                    f"model's projection {expected[0]} -> {expected[1]} (an adapter of another model?)")

    def _check_block(self, path: str, name: str, block: str) -> None:
        """A Mamba model's adapter names its mixers only; another model's names no Mamba mixer."""
        if self._state_space and block != "mixer":
            _fail(path, f"{name}: {self._arch} has no {block} layers (adapt its mixers' "
                        f"{', '.join(f'mixer.{p}' for p in self._shapes)})")
        if block == "mixer" and not self._state_space:
            _fail(path, f"{name}: the Mamba mixers of {self._arch} take no adapters (its attention's and MLPs' "
                        "projections do)")

    def _check_experts(self, path: str, name: str, module: AdapterModule, layer: int, projection: str) -> bool:
        """Check an MLP matrix of a mixture of experts; False: a dense MLP's, left to the caller."""
        moe = self._experts[layer] if self._experts is not None else None
        if not is_expert_path(projection):
            if moe is not None and self._layer_shapes is None:  # Gemma 4's MoE layers keep a dense MLP beside
                _fail(path, f"{name}: layer {layer} of {self._arch} is a mixture of experts: its MLP has no "
                            f"{projection} (adapt mlp.experts.gate_up_proj / down_proj)")
            return False
        if moe is not None and not self._adaptable_experts:
            _fail(path, f"{name}: adapters on the experts of {self._arch} are not built (docs/models.md's LoRA column "
                        "marks the families that take them; the attention's projections work here)")
        problem = expert_problem(projection, module, moe, self._hidden, self._transposed_experts)
        if problem is not None:
            _fail(path, f"{name}: layer {layer} of {self._arch} {problem}")
        return True


class _Flight:
    """One check in flight (`AdapterChecker.checking`): the request as given, the future of its outcome, the id's
    check it waits for (if any), and whether `AdapterChecker.forget` removed its id meanwhile."""

    __slots__ = ("request", "future", "before", "removed")

    def __init__(self, request: LoRARequest, before: _Flight | None) -> None:
        self.request, self.before, self.removed = request, before, False
        self.future: concurrent.futures.Future[LoRARequest] = concurrent.futures.Future()
        self.future.set_running_or_notify_cancel()  # running: a waiter's cancel (asyncio.wrap_future's) cancels none


def _fused_hint(projection: str) -> str:
    if projection in ("qkv_proj", "gate_up_proj"):
        return "; an adapter of a fused checkpoint (Phi-3) on a model with separate projections?"
    return "; its checkpoint fuses q, k, v and gate, up, and so do its adapters (an adapter of another model?)"


def _same_adapter(known: tuple[LoRARequest, LoRARequest], request: LoRARequest) -> LoRARequest:
    """The checked adapter of a known id (`known`: as given, as checked) that `request` names again;
    `InvalidRequestError` when it names another: one id, one adapter."""
    given, checked = known
    if given != request and not _same_folder(checked, request):
        raise InvalidRequestError(_FIELD, f"lora_int_id {request.lora_int_id} already names adapter "
                                          f"{checked.lora_name!r} at {checked.lora_path}: one id, one adapter")
    return checked


def _settled(outcome: LoRARequest | None = None, error: BaseException | None = None
             ) -> concurrent.futures.Future[LoRARequest]:
    """A future done already: `outcome`, or `error`."""
    future: concurrent.futures.Future[LoRARequest] = concurrent.futures.Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(outcome)  # type: ignore[arg-type]
    return future


def _request_error(request: LoRARequest, exc: BaseException) -> InvalidRequestError:
    """A check's failure as the requests' typed error (anything but an `InvalidRequestError` named as such)."""
    if isinstance(exc, InvalidRequestError):
        return exc
    return InvalidRequestError(_FIELD, f"lora_path {request.lora_path!r} could not be checked "
                                       f"({type(exc).__name__}: {exc})")


def _same_folder(checked: LoRARequest, request: LoRARequest) -> bool:
    """Whether a repeated id names the adapter it was checked with (same name, same local folder)."""
    return request.lora_name == checked.lora_name and os.path.isdir(request.lora_path) and (
        os.path.realpath(request.lora_path) == os.path.realpath(checked.lora_path))


def _resolve(path: str) -> str:
    from asyncllm.models.checkpoint import resolve_model_path

    try:
        return os.path.abspath(resolve_model_path(path))
    except ConfigError as exc:
        raise InvalidRequestError(_FIELD, f"lora_path {path!r}: {exc.allowed}") from exc
