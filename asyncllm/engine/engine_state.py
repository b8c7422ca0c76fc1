"""`EngineState`: vLLM's ``AsyncLLM`` health and state calls on `AsyncEngine` (asyncllm/engine/async_engine.py), a
mixin, for code ported from vLLM (a liveness probe calling ``check_health``): whether the engine serves, its error
once it died, the tasks its model serves, the model's name (`model_name`). `AsyncEngine.stats` has the numbers
behind them (``engine_alive``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncllm.errors import EngineDeadError

if TYPE_CHECKING:
    from asyncllm.engine.pooling_model import PoolingModel
    from asyncllm.engine.replica import ReplicaSet
    from asyncllm.metrics.observer import RequestObserver
    from asyncllm.outputs import EngineStats
    from asyncllm.speech import SpeechToText

__all__ = ["EngineState"]


class EngineState:
    """Mixin of `AsyncEngine`: vLLM's ``check_health``, ``is_running``, ``is_stopped``, ``errored``, ``dead_error``
    and ``get_supported_tasks``."""

    _closed: bool
    _replicas: ReplicaSet
    _observer: RequestObserver
    pooling_model: PoolingModel | None
    speech_to_text: SpeechToText | None

    if TYPE_CHECKING:
        @property
        def started(self) -> bool: ...

        def stats(self) -> EngineStats: ...

        async def start(self) -> None: ...

    async def check_health(self) -> None:
        """Return while the engine serves or can start (vLLM's ``check_health``); `EngineDeadError` once it was
        closed, or its core died and was not restarted (`dead_error`)."""
        if self.errored:
            raise self.dead_error

    @property
    def is_running(self) -> bool:
        """Started, not closed, and its engine core alive (vLLM's ``is_running``)."""
        return self.started and not self._closed and self.stats().engine_alive

    @property
    def is_stopped(self) -> bool:
        """Closed (`aclose`): it serves no request again (vLLM's ``is_stopped``)."""
        return self._closed

    @property
    def errored(self) -> bool:
        """Closed, or started with no engine core serving and none being restarted (vLLM's ``errored``): a core the
        host restarts (``max_core_restarts``, docs/reliability.md) is not, its requests wait for the new one."""
        if self._closed:
            return True
        return self.started and not self.stats().engine_alive and not any(
            replica.supervisor.restarting for replica in self._replicas)

    @property
    def dead_error(self) -> EngineDeadError:
        """The error a request gets from an `errored` engine, naming the cause (vLLM's ``dead_error``)."""
        if self._closed or not self.started:
            return EngineDeadError("the engine was closed" if self._closed else "the engine has not started")
        return self._replicas.dead_error()

    async def get_supported_tasks(self) -> tuple[str, ...]:
        """What the model serves, in vLLM's task names (vLLM's ``get_supported_tasks``; starts the engine): a
        classifier's ``("classify", "score", "token_classify")`` (a token classifier's, ``BertForTokenClassification``
        & co., ``("token_classify",)``), an
        encoder's ``("embed", "token_embed")``, a causal LM's
        ``("generate", "embed", "token_embed")`` (asyncllm's causal LMs embed too; ``("generate",)`` with
        runner='generate', ``("embed", "token_embed")`` with runner='pooling'), a reward model's (convert='reward')
        ``("token_classify",)``, a speech-to-text model's with
        ``"transcription"``. ``token_embed``: per-token embeddings (`encode`), served wherever ``embed`` is."""
        await self.start()
        model = self.pooling_model
        pooling = ("embed", "token_embed") if model is None else model.pooling_tasks
        if "embed" not in pooling:  # a classifier's or a reward model's (convert='reward': vLLM's as_reward_model)
            return pooling
        tasks = ("generate", *pooling) if model is None or model.generates else pooling
        if model is not None and model.runner == "generate":  # runner='generate': no pooling (vLLM's)
            tasks = ("generate",)
        return (*tasks, "transcription") if self.speech_to_text is not None and "generate" in tasks else tasks

    @property
    def model_name(self) -> str | None:
        """The model as named (vLLM's model as given: a hub id, not the folder it resolved to; the bundled model's
        ``asyncllm-tiny``), the name a server serves it as when given no served model name; a host attached to a
        shared core (`connect`): the core's launcher's (its ``asyncllm engine MODEL``), None until attached."""
        return self._observer.model_name
