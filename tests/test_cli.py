"""`llmq` as a user types it: the worker command's help and its refusals."""

from __future__ import annotations

import pytest

from llmq.cli import main


def test_llmq_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for command in ("generate", "models", "worker"):
        assert command in out


def test_worker_help_is_complete(capsys):
    with pytest.raises(SystemExit):
        main(["worker", "--help"])
    out = capsys.readouterr().out
    for flag in ("--models", "--queues", "--device", "--max-batch", "--name", "--grace"):
        assert flag in out
    for env in ("REDIS_URL", "LLMQ_POOL_CAPACITY", "LLMQ_POOL_MEMORY_MB"):
        assert env in out


def test_worker_refuses_an_unknown_model_with_one_line(capsys):
    assert main(["worker", "--models", "no-such-model"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("llmq: error: unknown model 'no-such-model'")
    assert "Traceback" not in err


def test_worker_device_choice_is_checked(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["worker", "--device", "tpu"])
    assert exited.value.code == 2
