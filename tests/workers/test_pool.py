"""The engine pool: LRU by count and memory, loads in the background, never evicts a model
with work in flight, and turns load failures into job errors instead of crashes."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from runtime.errors import ModelFormatError
from workers.errors import ModelLoadError, PoolFull, UnknownModelError
from workers.pool import FAILED, LOADING, READY, EnginePool, PoolConfig


@dataclass
class FakeEngine:
    source: str
    nbytes: int = 100 * 2**20
    context_length: int = 512


def make_pool(capacity: int = 2, memory_mb: float | None = None, **sizes: int) -> EnginePool:
    def loader(source: str) -> FakeEngine:
        if source == "broken":
            raise ModelFormatError("not a GGUF file")
        return FakeEngine(source, sizes.get(source, 100) * 2**20)

    models = {m: m for m in ("a", "b", "c", "broken", *sizes)}
    return EnginePool(PoolConfig(capacity=capacity, memory_mb=memory_mb), models, loader)


def ready(pool: EnginePool, model: str):
    entry = pool.request(model)
    pool.wait_loaded(5)
    return entry


def test_loads_in_the_background_then_serves_the_same_engine():
    gate = threading.Event()
    pool = EnginePool(PoolConfig(), {"a": "a"}, lambda s: gate.wait(5) and FakeEngine(s))
    entry = pool.request("a")
    assert entry.state == LOADING and pool.poll() == []
    gate.set()
    assert pool.wait_loaded(5) == [entry]
    assert entry.state == READY and entry.memory_bytes == 100 * 2**20
    assert pool.request("a") is entry
    assert pool.snapshot()["a"] == {
        "state": "ready",
        "device": "cpu",  # an engine that does not say runs on the cpu
        "memory_mb": 100.0,
        "in_flight": 0,
        "error": None,
        "load_seconds": entry.describe()["load_seconds"],
        "loaded_at": entry.loaded_at,
    }
    assert time.time() - 5 < entry.loaded_at <= time.time()


def test_evicts_the_least_recently_used_idle_model_at_capacity():
    pool = make_pool(capacity=2)
    ready(pool, "a")
    ready(pool, "b")
    pool.request("a")  # a is now more recent than b
    ready(pool, "c")
    assert pool.get("b") is None and pool.get("a") is not None and pool.get("c") is not None


def test_preload_fills_free_slots_in_order_and_evicts_nothing():
    pool = make_pool(capacity=2)
    ready(pool, "a")  # asked for by a job or an admin before the preload
    assert pool.preload(["b", "c", "a"]) == ["b"]
    assert pool.loading
    pool.wait_loaded(5)
    assert not pool.loading
    assert pool.get("a").state == READY and pool.get("b").state == READY
    assert pool.get("c") is None


def test_a_preload_beyond_the_memory_budget_is_dropped_not_failed():
    pool = make_pool(capacity=4, memory_mb=250, a=100, b=100, c=120)
    ready(pool, "a")
    assert pool.preload(["b", "c"]) == ["b", "c"]
    pool.wait_loaded(5)
    pool.wait_loaded(5)  # c loads after b (one loader thread)
    assert pool.get("a").state == READY and pool.get("b").state == READY
    assert pool.get("c") is None  # not FAILED: its first job loads it (evicting as usual)
    assert ready(pool, "c").state == READY and pool.get("a") is None


def test_never_evicts_a_model_with_work_in_flight():
    pool = make_pool(capacity=1)
    ready(pool, "a")
    pool.acquire("a")
    assert not pool.can_accept("b")
    with pytest.raises(PoolFull):
        pool.request("b")
    pool.release("a")
    assert pool.can_accept("b")
    ready(pool, "b")
    assert pool.get("a") is None


def test_memory_budget_evicts_idle_models_and_refuses_what_cannot_fit():
    pool = make_pool(capacity=4, memory_mb=250, a=100, b=100, c=120, huge=300)
    ready(pool, "a")
    ready(pool, "b")
    ready(pool, "c")  # 320 MiB would not fit: the least recent (a) goes
    assert pool.get("a") is None and pool.used_bytes("cpu") == 220 * 2**20
    entry = ready(pool, "huge")
    assert entry.state == FAILED and isinstance(entry.error, ModelLoadError)
    assert "300 MiB" in str(entry.error) and "LLMQ_POOL_MEMORY_MB" in str(entry.error)
    assert pool.get("b").state == pool.get("c").state == READY  # nothing evicted in vain


@dataclass
class DeviceEngine(FakeEngine):
    """An engine on a device that holds more there than its weights (a GPU's KV pool)."""

    device: str = "cuda:0"
    device_bytes: int = 0


def device_pool(memory_mb: float, **placed: tuple[str, int]) -> EnginePool:
    """A pool of models each on (device, MiB it holds there); weights are 10 MiB each."""

    def loader(source: str) -> DeviceEngine:
        device, mib = placed[source]
        return DeviceEngine(source, 10 * 2**20, device=device, device_bytes=mib * 2**20)

    return EnginePool(PoolConfig(capacity=8, memory_mb=memory_mb), {m: m for m in placed}, loader)


def test_each_device_gets_the_whole_memory_budget_and_counts_what_the_engine_holds_there():
    pool = device_pool(250, g=("cuda:0", 200), h=("cuda:1", 200), c=("cpu", 200))
    for model in ("g", "h", "c"):
        assert ready(pool, model).state == READY  # 600 MiB in all, 200 on each device
    assert [pool.used_bytes(d) // 2**20 for d in ("cuda:0", "cuda:1", "cpu")] == [200] * 3
    shown = pool.snapshot()["g"]
    assert shown["device"] == "cuda:0" and shown["memory_mb"] == 200.0  # not the 10 of weights


def test_the_memory_budget_evicts_only_idle_models_on_the_new_models_device():
    pool = device_pool(
        250, old_gpu=("cuda:0", 100), cpu=("cpu", 200), busy=("cuda:0", 100), new=("cuda:0", 120)
    )
    ready(pool, "old_gpu")
    ready(pool, "cpu")  # the least recent of all once old_gpu is used again, but on the cpu
    ready(pool, "busy")
    pool.acquire("busy")
    pool.request("old_gpu")
    ready(pool, "cpu").last_used = 0.0
    assert ready(pool, "new").state == READY  # 320 MiB on cuda:0: old_gpu goes, busy stays
    assert pool.get("old_gpu") is None
    assert pool.get("cpu").state == pool.get("busy").state == READY


def test_a_model_that_cannot_fit_its_device_says_which_device():
    pool = device_pool(250, busy=("cuda:0", 200), big=("cuda:0", 100), small=("cpu", 100))
    ready(pool, "small")
    ready(pool, "busy")
    pool.acquire("busy")
    entry = ready(pool, "big")
    assert entry.state == FAILED and pool.get("small").state == READY  # the cpu's is no help
    assert str(entry.error) == (
        "model big needs 100 MiB but only 50 MiB of the 250 MiB pool budget "
        "(LLMQ_POOL_MEMORY_MB) on cuda:0 is free"
    )


def test_a_failed_load_is_an_error_for_its_jobs_and_is_retried_later():
    pool = make_pool()
    entry = ready(pool, "broken")
    assert entry.state == FAILED and "not a GGUF file" in str(entry.error)
    assert entry.error.body()["status"] == 500
    assert pool.request("broken") is entry  # fails fast within the retry window
    pool.config.retry_failed_seconds = 0
    assert pool.request("broken") is not entry


def test_an_unknown_model_is_a_404():
    with pytest.raises(UnknownModelError) as caught:
        make_pool().request("nope")
    body = caught.value.body()
    assert body["status"] == 404 and body["error"]["code"] == "model_not_found"


def test_unload_waits_for_work_in_flight():
    pool = make_pool()
    ready(pool, "a")
    pool.acquire("a", 2)
    assert pool.unload("a") and pool.get("a") is not None
    pool.release("a")
    assert pool.get("a") is not None
    pool.release("a")
    assert pool.get("a") is None
    assert not pool.unload("a")


def test_config_from_env():
    config = PoolConfig.from_env({"LLMQ_POOL_CAPACITY": "3", "LLMQ_POOL_MEMORY_MB": "512"})
    assert (config.capacity, config.memory_mb) == (3, 512.0)
    assert PoolConfig.from_env({}).memory_mb is None
    with pytest.raises(ValueError, match="LLMQ_POOL_CAPACITY"):
        PoolConfig(capacity=0)
