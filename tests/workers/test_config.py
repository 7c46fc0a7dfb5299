"""What a worker serves: `--models` and `--queues` resolved to model sources and queues."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers import keys
from workers.config import ConfigError, WorkerConfig, serving
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
        (dict(max_batch=0), "--max-batch"),
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
