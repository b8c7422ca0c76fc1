"""A request whose LoRA adapter is a hub id new to the engine waits, parked, while the host resolves (downloads) and
checks it off the processor thread: other requests, with no adapter or a checked one, stream to their end meanwhile;
requests naming the id, and `add_lora` of it, share one download; an abort ends the waiting request and nothing
reaches the core; a failed download is each waiting request's `InvalidRequestError` and the engine serves on. The
hub's download (huggingface_hub's `snapshot_download`, in this process: the host's `AdapterChecker` runs here) is
faked and held by an event. The checker's half alone: tests/unit/test_lora_checking.py."""

from __future__ import annotations

import asyncio
import threading

import huggingface_hub
import pytest
import pytest_asyncio

from asyncllm import AsyncEngine, InvalidRequestError, LoRARequest, SamplingParams, lora_checker
from asyncllm.metrics.observer import RequestObserver
from hf_reference import hf_greedy
from lora_utils import make_adapter, peft_greedy

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llama: str):
    async with AsyncEngine(tiny_llama, enable_lora=True, max_loras=2, disable_log_stats=True) as engine:
        yield engine


class _Hub:
    """huggingface_hub's download, faked: each repo a local adapter folder, held until its gate is set, or failing
    with `error`; the host's resolutions (`lora_checker._resolve`), the downloads' threads, the requests added."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.repos: dict[str, tuple[str, threading.Event, BaseException | None]] = {}
        self.started = threading.Event()
        self.resolved: list[str] = []
        self.threads: set[str] = set()
        self.added: list[str] = []
        resolve, on_added = lora_checker._resolve, RequestObserver.on_added
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cache alone: no lookup of the (unreachable) hub first
        monkeypatch.setattr(huggingface_hub, "snapshot_download", self._download)
        monkeypatch.setattr(lora_checker, "_resolve", lambda path: self.resolved.append(path) or resolve(path))
        monkeypatch.setattr(RequestObserver, "on_added", lambda observer, job: (
            self.added.append(job.collector.request_id) or on_added(observer, job)))

    def repo(self, repo_id: str, folder: str, error: BaseException | None = None) -> threading.Event:
        """Serve `folder` as `repo_id`, once the returned gate is set."""
        gate = threading.Event()
        self.repos[repo_id] = (folder, gate, error)
        return gate

    def _download(self, repo_id: str, **_: object) -> str:
        folder, gate, error = self.repos[repo_id]
        self.threads.add(threading.current_thread().name)
        self.started.set()
        assert gate.wait(60)
        if error is not None:
            raise error
        return folder

    async def wait_started(self) -> None:
        assert await asyncio.to_thread(self.started.wait, 60)


async def test_a_downloading_adapter_stalls_no_other_stream_and_downloads_once(
        tiny_llama: str, engine: AsyncEngine, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    known = LoRARequest("known", 1, make_adapter(tiny_llama, str(tmp_path / "known"), seed=1, rank=4))
    await engine.add_lora(known)  # checked already
    hub = _Hub(monkeypatch)
    folder = make_adapter(tiny_llama, str(tmp_path / "slow"), seed=51, rank=8)
    gate = hub.repo("asyncllm-test/slow-adapter", folder)
    slow = LoRARequest("slow", 51, "asyncllm-test/slow-adapter")
    waiting = [asyncio.create_task(engine.generate(prompt, GREEDY, lora_request=slow)) for prompt in ([5, 6, 7], [9])]
    adding = asyncio.create_task(engine.add_lora(slow))
    try:
        await hub.wait_started()
        base = await asyncio.wait_for(engine.generate([8, 9], GREEDY), 60)  # served while the download waits
        assert base.outputs[0].token_ids == hf_greedy(tiny_llama, [8, 9], MAX_TOKENS)
        other = await asyncio.wait_for(engine.generate([4, 5, 6], GREEDY, lora_request=known), 60)
        assert other.outputs[0].token_ids == peft_greedy(tiny_llama, known.lora_path, [4, 5, 6], MAX_TOKENS)
        assert not any(task.done() for task in (*waiting, adding))
    finally:
        gate.set()
    outs = await asyncio.wait_for(asyncio.gather(*waiting, adding), 60)
    for prompt, out in zip(([5, 6, 7], [9]), outs):
        assert out.outputs[0].token_ids == peft_greedy(tiny_llama, folder, prompt, MAX_TOKENS)
    assert hub.resolved == ["asyncllm-test/slow-adapter"]  # two requests and add_lora: one download
    assert hub.threads == {"asyncllm-lora-check"}  # neither the loop's thread nor the processor's
    assert 51 in await engine.list_loras()


async def test_an_abort_while_the_adapter_downloads_ends_the_request_and_sends_nothing(
        tiny_llama: str, engine: AsyncEngine, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = _Hub(monkeypatch)
    folder = make_adapter(tiny_llama, str(tmp_path / "abort"), seed=52, rank=4)
    gate = hub.repo("asyncllm-test/abort-adapter", folder)
    lora = LoRARequest("abort", 52, "asyncllm-test/abort-adapter")
    aborted = asyncio.create_task(engine.generate([5, 6, 7], GREEDY, lora_request=lora, request_id="waits"))
    left = asyncio.create_task(engine.generate([5, 6], GREEDY, lora_request=lora, request_id="leaves"))
    try:
        await hub.wait_started()
        await asyncio.sleep(0.2)  # both parked on the processor thread
        await engine.abort("waits")
        out = await asyncio.wait_for(aborted, 30)  # at once: the download still waits
        assert [(o.finish_reason, o.token_ids) for o in out.outputs] == [("abort", [])]
        left.cancel()  # its stream left
        with pytest.raises(asyncio.CancelledError):
            await left
        again = asyncio.create_task(engine.generate([5, 6, 7], GREEDY, lora_request=lora, request_id="waits"))
        base = await asyncio.wait_for(engine.generate([8, 9], GREEDY), 60)
        assert base.outputs[0].token_ids == hf_greedy(tiny_llama, [8, 9], MAX_TOKENS) and not again.done()
    finally:
        gate.set()
    out = await asyncio.wait_for(again, 60)  # the id used again, under the aborted one's request_id
    assert out.outputs[0].token_ids == peft_greedy(tiny_llama, folder, [5, 6, 7], MAX_TOKENS)
    assert hub.added.count("waits") == 1 and "leaves" not in hub.added  # the aborted ones never reached the core
    assert hub.resolved == ["asyncllm-test/abort-adapter"]


async def test_a_failed_download_is_each_waiting_requests_error_and_the_engine_serves_on(
        tiny_llama: str, engine: AsyncEngine, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = _Hub(monkeypatch)
    folder = make_adapter(tiny_llama, str(tmp_path / "broken"), seed=53, rank=4)
    gate = hub.repo("asyncllm-test/broken-adapter", folder, RuntimeError("the hub answered garbage"))
    lora = LoRARequest("broken", 53, "asyncllm-test/broken-adapter")
    waiting = [asyncio.create_task(engine.generate([5, 6, 7], GREEDY, lora_request=lora)) for _ in range(2)]
    try:
        await hub.wait_started()
        base = await asyncio.wait_for(engine.generate([8, 9], GREEDY), 60)
        assert base.outputs[0].token_ids == hf_greedy(tiny_llama, [8, 9], MAX_TOKENS)
    finally:
        gate.set()
    for task in waiting:
        with pytest.raises(InvalidRequestError, match="RuntimeError: the hub answered garbage") as raised:
            await asyncio.wait_for(task, 60)
        assert raised.value.field == "lora_request" and "asyncllm-test/broken-adapter" in raised.value.message
    assert hub.resolved == ["asyncllm-test/broken-adapter"] and 53 not in await engine.list_loras()
    hub.repo("asyncllm-test/broken-adapter", folder).set()  # the hub answers again: nothing kept the failure
    out = await asyncio.wait_for(engine.generate([5, 6, 7], GREEDY, lora_request=lora), 60)
    assert out.outputs[0].token_ids == peft_greedy(tiny_llama, folder, [5, 6, 7], MAX_TOKENS)
    assert (await engine.generate([8, 9], GREEDY)).outputs[0].token_ids == base.outputs[0].token_ids


async def test_remove_lora_while_the_adapter_downloads_wins(tiny_llama: str, engine: AsyncEngine, tmp_path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`remove_lora` of an id whose check is in flight: the requests parked on it and `add_lora` of it fail with an
    `InvalidRequestError` saying it was removed, and nothing of it is left bound (host or core): the id names
    another folder at once."""
    hub = _Hub(monkeypatch)
    folder = make_adapter(tiny_llama, str(tmp_path / "removed"), seed=54, rank=4)
    gate = hub.repo("asyncllm-test/removed-adapter", folder)
    lora = LoRARequest("removed", 54, "asyncllm-test/removed-adapter")
    joined: list[int] = []  # the ids whose in-flight check a call joined (the request's on the processor thread)
    checking = lora_checker.AdapterChecker.checking
    monkeypatch.setattr(lora_checker.AdapterChecker, "checking",
                        lambda checker, request: joined.append(request.lora_int_id) or checking(checker, request))
    waiting = [asyncio.create_task(engine.generate([5, 6, 7], GREEDY, lora_request=lora, request_id="parked")),
               asyncio.create_task(engine.add_lora(lora))]
    try:
        await hub.wait_started()
        for _ in range(3000):  # both parked on the check before the removal (a later call would check afresh)
            if joined.count(54) == 2:
                break
            await asyncio.sleep(0.01)
        assert joined.count(54) == 2
        assert await engine.remove_lora(54) is True  # it was being checked
    finally:
        gate.set()
    for task in waiting:
        with pytest.raises(InvalidRequestError, match="lora_int_id 54 was removed \\(remove_lora\\)") as raised:
            await asyncio.wait_for(task, 60)
        assert raised.value.field == "lora_request"
    assert 54 not in await engine.list_loras() and "parked" not in hub.added  # it never reached the core
    other = make_adapter(tiny_llama, str(tmp_path / "other"), seed=55, rank=8)
    out = await asyncio.wait_for(engine.generate([5, 6, 7], GREEDY, lora_request=LoRARequest("other", 54, other)), 60)
    assert out.outputs[0].token_ids == peft_greedy(tiny_llama, other, [5, 6, 7], MAX_TOKENS)
