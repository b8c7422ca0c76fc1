"""data_parallel_size: validation, device assignment, the balancer's score, summed stats (no engine started)."""

from __future__ import annotations

import gc
import weakref

import pytest

from asyncllm import AsyncEngine, ConfigError, EngineConfig
from asyncllm.engine.admission import HostAdmission
from asyncllm.engine.collector import RequestCollector
from asyncllm.engine.data_parallel import combined_stats, load_score, replica_devices, replica_env
from asyncllm.engine.replica import weakly
from asyncllm.errors import NotBuiltError
from asyncllm.outputs import EngineStats
from asyncllm.protocol import SchedulerStats


@pytest.mark.parametrize("value", [0, -1, 65, 1.5, True, "2"])
def test_bad_data_parallel_sizes_are_refused(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.create("m", data_parallel_size=value)
    assert info.value.field == "data_parallel_size"


def test_expert_parallel_with_data_parallel_is_not_built() -> None:
    assert EngineConfig.create("m", data_parallel_size=2).data_parallel_size == 2
    with pytest.raises(NotBuiltError) as info:
        EngineConfig.create("m", data_parallel_size=2, enable_expert_parallel=True)
    assert info.value.field == "enable_expert_parallel" and "data_parallel_size > 1" in str(info.value)


def test_a_shared_core_with_data_parallel_is_not_built(tmp_path) -> None:
    with pytest.raises(ConfigError, match="data_parallel_size=2 is not allowed: core-side"):  # the core's field
        AsyncEngine.connect(f"ipc://{tmp_path}/engine.sock", data_parallel_size=2)
    from asyncllm.engine.standalone import run_standalone_core

    with pytest.raises(NotBuiltError, match="standalone engine core"):
        run_standalone_core(EngineConfig.create("m", data_parallel_size=2), f"ipc://{tmp_path}/engine.sock")


def test_replica_i_gets_devices_i_tp_to_i_plus_1_tp(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    devices = replica_devices(EngineConfig.create("m", device="cuda", data_parallel_size=2, tensor_parallel_size=2))
    assert devices == [["4", "5"], ["6", "7"]]
    assert replica_env(devices, 1) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    stages = EngineConfig.create("m", device="cuda", data_parallel_size=2, pipeline_parallel_size=2)
    assert replica_devices(stages) == [["4", "5"], ["6", "7"]]  # each replica's two stages
    assert replica_devices(EngineConfig.create("m", device="cpu", data_parallel_size=2)) is None
    assert replica_devices(EngineConfig.create("m", device="cuda")) is None  # one replica: the environment as is
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert replica_devices(EngineConfig.create("m", device="auto", data_parallel_size=2)) is None  # no GPU: CPU


def test_too_few_devices_is_a_config_error(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with pytest.raises(ConfigError) as info:
        replica_devices(EngineConfig.create("m", device="auto", data_parallel_size=2, tensor_parallel_size=2))
    assert info.value.field == "data_parallel_size" and "4 CUDA devices, but 3 are visible" in str(info.value)


@pytest.mark.parametrize(("sizes", "field", "value"), [
    ({"tensor_parallel_size": 2}, "tensor_parallel_size", 2),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size", 2),  # was "tensor_parallel_size=2" from worker rank 1
    ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, "pipeline_parallel_size", 2),
])
def test_too_few_devices_for_one_replica_name_the_field_set_before_any_worker_starts(monkeypatch, sizes, field,
                                                                                     value) -> None:
    monkeypatch.setattr("asyncllm.engine.data_parallel.driver_gpu_count", lambda: 8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ConfigError) as info:
        replica_devices(EngineConfig.create("m", device="auto", **sizes))
    assert (info.value.field, info.value.value) == (field, value) and "but 1 are visible" in str(info.value)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert replica_devices(EngineConfig.create("m", device="cuda", **sizes)) is None  # enough: the environment as is
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert replica_devices(EngineConfig.create("m", device="auto", **sizes)) is None  # no GPU: the CPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr("asyncllm.engine.data_parallel.driver_gpu_count", lambda: 0)
    assert replica_devices(EngineConfig.create("m", device="auto", **sizes)) is None  # no driver: the CPU


def test_a_worker_rank_past_the_devices_names_the_field_set(monkeypatch) -> None:
    import torch

    from asyncllm.workers.worker import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError) as info:  # pipeline_parallel_size=2 on one GPU: rank 1 has none
        resolve_device("cuda", 1, 1, 2)
    assert (info.value.field, info.value.value) == ("pipeline_parallel_size", 2)
    with pytest.raises(ConfigError) as info:
        resolve_device("cuda", 3, 4, 1)
    assert (info.value.field, info.value.value) == ("tensor_parallel_size", 4) and "1 are visible" in str(info.value)


def test_the_score_counts_waiting_four_times_and_what_the_snapshot_does_not_count_yet() -> None:
    admission = HostAdmission(None, None)  # no queue limit: it still counts for the balancer

    def score(stats: SchedulerStats) -> int:
        return load_score(stats, admission.num_waiting(stats))

    snapshot = SchedulerStats(num_requests_running=3, num_requests_waiting=1)
    assert score(snapshot) == 4 * 1 + 3
    admission.admit(snapshot, "x", chat=False, num_samples=2)
    assert score(snapshot) == 4 * 3 + 3
    assert score(SchedulerStats(num_requests_running=3, num_requests_waiting=1)) == 4 * 3 + 3  # taken before they came
    assert score(SchedulerStats(num_requests_running=5, host_samples_queued=2)) == 5  # a new snapshot counts them itself


def test_requests_failing_before_a_new_snapshot_stop_steering_the_balancer() -> None:
    """Refused requests (by the processor thread or the core) never queued: `RequestCollector.put_error` un-counts
    them from their replica's estimate at once, so a burst of invalid requests does not make idle replica 0 look
    busy; one still in flight keeps counting."""
    from types import SimpleNamespace

    from asyncllm.engine.replica import Replica, ReplicaSet, pick_replica
    from asyncllm.errors import InvalidRequestError

    snapshot = SchedulerStats()  # both idle, and no new snapshot comes (the core never saw the refused requests)
    replicas = ReplicaSet([Replica(i, SimpleNamespace(stats=SimpleNamespace(scheduler=snapshot)),  # type: ignore
                                   HostAdmission(None, None), None, processor=SimpleNamespace(dead=None))  # type: ignore
                           for i in range(2)])

    def submit(request_id: str) -> RequestCollector:  # as `AsyncEngine._submit`
        replica = pick_replica(replicas.replicas)
        assert replica is not None
        collector = RequestCollector(request_id, 0.0, admitted=replica.admission.admit(snapshot, [1, 2], chat=False))
        replicas.placed(replica, collector)
        return collector

    for i in range(3):
        refused = submit(f"bad{i}")
        assert refused.replica == 0
        refused.put_error(InvalidRequestError("prompt", "too long"))
    assert [submit("ok").replica, submit("next").replica] == [0, 1]  # "ok" is in flight: it counts on replica 0


def test_combined_stats_add_up_and_keep_each_replica() -> None:
    a = EngineStats(num_requests_running=2, num_gpu_blocks=10, num_used_blocks=5, prefix_cache_hits=3,
                    request_success_total={"stop": 1}, spec_decode_accepted_per_pos=[1, 2])
    b = EngineStats(num_requests_running=1, num_gpu_blocks=30, num_used_blocks=3, engine_alive=False,
                    request_success_total={"stop": 2, "abort": 1}, spec_decode_accepted_per_pos=[4])
    total = combined_stats([a, b])
    assert (total.num_requests_running, total.num_gpu_blocks, total.num_used_blocks) == (3, 40, 8)
    assert total.kv_cache_usage == 8 / 40 and total.prefix_cache_hits == 3 and total.engine_alive
    assert total.request_success_total == {"stop": 3, "abort": 1}
    assert total.spec_decode_accepted_per_pos == [5, 2]
    assert total.replicas == [a, b]
    assert not combined_stats([b]).engine_alive
    a.weights_version, b.weights_version = 3, 1  # a dead replica's older weights hold back no version
    assert combined_stats([a, b]).weights_version == 3 and combined_stats([b]).weights_version == 1


def test_replicas_export_every_series_per_engine_label() -> None:
    from prometheus_client import CollectorRegistry

    from asyncllm.metrics.host_stats import HostStats
    from asyncllm.metrics.prometheus import attach

    registry = CollectorRegistry()
    replicas = [HostStats("m"), HostStats("m")]
    for index, stats in enumerate(replicas):
        stats.engine_index, stats.reports_engine = index, True
        stats.scheduler = SchedulerStats(num_requests_running=index + 1, num_preemptions_total=10 * index)
        stats.prompt_tokens_total = 5
        attach(stats, registry)
    value = registry.get_sample_value
    assert value("asyncllm:num_requests_running", {"model_name": "m", "engine": "1"}) == 2
    assert value("asyncllm:num_preemptions_total", {"model_name": "m", "engine": "1"}) == 10
    assert value("asyncllm:num_requests_running", {"model_name": "m"}) is None
    assert [value("asyncllm:prompt_tokens_total", {"model_name": "m", "engine": str(i)}) for i in (0, 1)] == [5, 5]


def test_a_replica_awaiting_weights_is_picked_only_when_every_replica_is() -> None:
    """A replica restarted after a push (or woken after a level-2 sleep) runs nothing until weights come: new
    requests go to the others, however loaded."""
    from types import SimpleNamespace

    from asyncllm.engine.replica import pick_replica

    def replica(index: int, score: int, awaiting: bool, sleep_level: int = 0) -> SimpleNamespace:
        stats = SimpleNamespace(scheduler=SchedulerStats(awaiting_weights=awaiting, sleep_level=sleep_level))
        return SimpleNamespace(index=index, alive=True, observer=SimpleNamespace(stats=stats), score=lambda: score)

    idle_but_awaiting, busy = replica(0, 0, True), replica(1, 40, False)
    assert pick_replica([idle_but_awaiting, busy]) is busy
    assert pick_replica([idle_but_awaiting, replica(1, 40, True)]) is idle_but_awaiting  # all await: the least loaded
    asleep = replica(0, 0, False, sleep_level=1)  # another restarted awake while the engine slept
    assert pick_replica([asleep, busy]) is busy and pick_replica([asleep, replica(1, 40, False, 1)]) is asleep



class _Sink:
    def __init__(self) -> None:
        self.got: list[tuple[object, ...]] = []

    def take(self, *args: object) -> int:
        self.got.append(args)
        return len(self.got)


async def test_a_collected_engines_deliveries_and_restarts_do_nothing() -> None:
    """The processor threads and core supervisors hold the engine weakly (`weakly`): once it is collected a delivery
    is dropped and a core's restart has nothing to do, and neither raises."""
    sink = _Sink()
    take, got = weakly(sink.take), sink.got
    assert take("batch", "stats") == 1 and got == [("batch", "stats")]
    del sink
    gc.collect()
    assert take("batch", "stats") is None and got == [("batch", "stats")]
    engine = AsyncEngine("m", data_parallel_size=2)
    supervisors, collected = [replica.supervisor for replica in engine._replicas.replicas], weakref.ref(engine)
    del engine
    gc.collect()
    assert collected() is None
    for supervisor in supervisors:
        await supervisor._restart()


async def test_a_request_id_in_flight_pinned_to_another_replica_is_refused() -> None:
    """Its abort would reach the new replica's request and leave the old one running: refused by name; pinned to
    its own replica, that replica's processor refuses the duplicate as ever."""
    from types import SimpleNamespace

    from asyncllm.engine.replica import Replica, ReplicaSet
    from asyncllm.errors import InvalidRequestError

    snapshot = SchedulerStats()
    replicas = ReplicaSet([Replica(i, SimpleNamespace(stats=SimpleNamespace(scheduler=snapshot)),  # type: ignore
                                   HostAdmission(None, None), None, processor=SimpleNamespace(dead=None))  # type: ignore
                           for i in range(2)])
    in_flight = RequestCollector("r", 0.0)
    replicas.placed(replicas.replicas[0], in_flight)
    with pytest.raises(InvalidRequestError, match="'r' is already in flight .on replica 0; data_parallel_rank=1"):
        await replicas.pick("r", 1)
