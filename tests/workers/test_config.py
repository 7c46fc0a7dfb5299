"""What a worker serves: `--models` and `--queues` resolved to model sources and queues."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers import keys
from workers.config import ConfigError, WorkerConfig, serving, worker_device
from workers.wire.commands import decode_command, encode_command


def test_models_give_both_queues_of_each_interactive_first(tiny_model: Path):
    sources, queues = serving(WorkerConfig(models=[str(tiny_model), "smollm2-135m-instruct"]))
    assert sources == {
        "tiny-llama": str(tiny_model),
        "smollm2-135m-instruct": "smollm2-135m-instruct",
    }
    assert queues == [
        "llmq-tiny-llama-interactive",
        "llmq-smollm2-135m-instruct-interactive",
        "llmq-tiny-llama-batch",
        "llmq-smollm2-135m-instruct-batch",
    ]


def test_queues_pick_kinds_or_name_queues(tiny_model: Path):
    _, queues = serving(WorkerConfig(models=[str(tiny_model)], queues=["batch"]))
    assert queues == ["llmq-tiny-llama-batch"]
    sources, queues = serving(WorkerConfig(queues=["llmq-smollm2-135m-instruct-batch"]))
    assert sources == {"smollm2-135m-instruct": "smollm2-135m-instruct"}
    assert queues == ["llmq-smollm2-135m-instruct-batch"]


def test_no_models_means_every_registry_model():
    sources, queues = serving(WorkerConfig())
    assert "smollm2-135m-instruct" in sources and len(queues) == 2 * len(sources)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (dict(models=["nope"]), "unknown model 'nope'"),
        (dict(queues=["default"]), "not an llmq queue name"),
        (dict(queues=["llmq-nope-batch"]), "model 'nope'"),
        (dict(max_sequences=0), "--max-batch"),
    ],
)
def test_bad_configurations_are_refused_with_a_clear_message(config, message):
    with pytest.raises(ConfigError, match=message):
        serving(WorkerConfig(**config))


def test_queue_names_round_trip_and_admin_commands_decode():
    assert keys.parse_queue_name(keys.queue_name("a-b-batch", keys.BATCH)) == ("a-b-batch", "batch")
    assert decode_command(encode_command("load", "m")) == ("load", "m")
    with pytest.raises(ValueError):
        decode_command(b'{"op": "format-disk", "model": "m"}')


def test_backend_comes_from_the_flag_or_llmq_backend(monkeypatch):
    monkeypatch.setenv("LLMQ_BACKEND", "numpy")
    assert WorkerConfig.from_env().backend == "numpy"
    assert WorkerConfig.from_env(backend="torch").backend == "torch"
    monkeypatch.setenv("LLMQ_BACKEND", "tensorflow")
    with pytest.raises(ConfigError, match="--backend must be one of numpy, torch"):
        WorkerConfig.from_env()


def test_a_cuda_device_is_refused_with_its_reason_never_run_on_the_cpu(monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    with pytest.raises(ConfigError, match="sees no CUDA device") as refused:
        WorkerConfig(device="cuda")
    assert "\n" not in str(refused.value) and "--device cpu" in str(refused.value)
    monkeypatch.setenv("LLMQ_DEVICE", "cuda:1")
    with pytest.raises(ConfigError, match="cuda:1"):
        WorkerConfig.from_env()
    with pytest.raises(ConfigError, match="device must be cpu or cuda"):
        WorkerConfig(device="tpu")


@pytest.fixture
def two_gpus(monkeypatch):
    """torch reporting two CUDA devices: what check_device asks on a GPU machine."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_a_cuda_device_is_normalised_and_batches_256_by_default(two_gpus):
    config = WorkerConfig(device="cuda")
    assert (config.device, config.max_sequences) == ("cuda:0", 256)
    # an explicit value wins
    assert WorkerConfig(device="cuda:1", max_sequences=8).max_sequences == 8
    with pytest.raises(ConfigError, match="this machine has 2 CUDA device"):
        WorkerConfig(device="cuda:2")


def test_without_a_device_each_model_decides_and_the_batch_is_the_cpus(monkeypatch):
    monkeypatch.delenv("LLMQ_DEVICE", raising=False)
    config = WorkerConfig.from_env()
    assert (config.device, config.max_sequences) == (None, 32)
    monkeypatch.setenv("LLMQ_DEVICE", "cpu")
    assert WorkerConfig.from_env().device == "cpu"
    assert WorkerConfig.from_env(device="cpu", max_sequences=4).max_sequences == 4


def test_a_worker_advertises_its_device_or_its_models_registry_devices(
    tiny_model: Path, tmp_path: Path, monkeypatch, two_gpus
):
    registry = tmp_path / "models.toml"
    registry.write_text(f'[models.gpu-tiny]\npath = "{tiny_model}"\ndevice = "cuda"\n')
    monkeypatch.setenv("LLMQ_MODELS", str(registry))
    both = WorkerConfig(models=["gpu-tiny", str(tiny_model)])
    assert worker_device(both, serving(both)[0]) == "cpu,cuda:0"
    only_gpu = WorkerConfig(models=["gpu-tiny"])
    assert worker_device(only_gpu, serving(only_gpu)[0]) == "cuda:0"
    forced = WorkerConfig(models=["gpu-tiny"], device="cpu")
    assert worker_device(forced, serving(forced)[0]) == "cpu"


def test_pool_entries_show_the_backend_and_its_kernels(tiny_model: Path):
    from workers.pool import PoolEntry, load_engine

    engine = load_engine(str(tiny_model), backend="numpy")
    entry = PoolEntry("tiny-llama", state="ready", engine=engine, memory_bytes=engine.nbytes)
    shown = entry.describe()
    assert shown["backend"] == "numpy"
    assert shown["kernels"] == {"float32": 1 + 4 * engine.model.args.n_layers}
    assert shown["memory_mb"] == round(engine.nbytes / 2**20, 1)
    fast = load_engine(str(tiny_model), backend="torch")
    assert fast.backend.name == "torch" and fast.nbytes < engine.nbytes


def test_the_pool_loads_each_model_on_the_workers_device(tiny_model: Path):
    """The worker's device reaches the engine: on the cpu it runs there; a GPU this machine
    lacks is a failed entry with the reason, never a silent CPU run."""
    import functools

    import torch

    from workers.pool import EnginePool, PoolConfig, load_engine

    sources = {"tiny-llama": str(tiny_model)}
    on_cpu = EnginePool(PoolConfig(), sources, functools.partial(load_engine, device="cpu"))
    on_cpu.request("tiny-llama")
    [entry] = on_cpu.wait_loaded(60)
    assert (entry.state, entry.device, entry.engine.device) == ("ready", "cpu", "cpu")
    assert entry.describe()["device"] == "cpu"
    if torch.cuda.is_available():
        return
    on_gpu = EnginePool(PoolConfig(), sources, functools.partial(load_engine, device="cuda:0"))
    on_gpu.request("tiny-llama")
    [entry] = on_gpu.wait_loaded(60)
    assert entry.state == "failed" and "sees no CUDA device" in str(entry.error)
