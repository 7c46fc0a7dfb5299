"""`llmq` as a user types it: help (with defaults) of every command, the version, and the
worker command's refusals."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from llmq.cli import build_parser, main


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
    for env in ("REDIS_URL", "LLMQ_POOL_CAPACITY", "LLMQ_POOL_MEMORY_MB", "LLMQ_DEVICE"):
        assert env in out
    assert "32 on the cpu, 256 on a cuda device" in " ".join(out.split())


def test_worker_refuses_an_unknown_model_with_one_line(capsys):
    assert main(["worker", "--models", "no-such-model"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("llmq: error: unknown model 'no-such-model'")
    assert "Traceback" not in err


def test_worker_device_choice_is_checked(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["worker", "--device", "tpu"])
    assert exited.value.code == 2
    assert "device must be cpu or cuda[:N], got 'tpu'" in capsys.readouterr().err


@pytest.mark.parametrize("how", [["--device", "cuda"], []])
def test_a_worker_asked_for_cuda_without_it_exits_with_one_line(how):
    """`llmq worker --device cuda` (or LLMQ_DEVICE=cuda) as a process on a machine without
    CUDA: one line on stderr and a non-zero exit, before it even looks for Redis (REDIS_URL
    points nowhere: a worker that went on would wait for it, and time out here)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    env = {**os.environ, "REDIS_URL": "redis://127.0.0.1:1/0", "LLMQ_DEVICE": "cuda"}
    done = subprocess.run(
        [sys.executable, "-m", "llmq", "worker", *how],
        cwd=Path(__file__).parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"llmq: error: device cuda:0: this torch ({torch.__version__}) sees no CUDA device; "
        "install a CUDA build of torch on a machine with an NVIDIA GPU, or use --device cpu"
    ]


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(argv prefix, parser) for `llmq` and every subcommand below it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _commands(child, (*path, name))


def test_every_help_shows_the_defaults(capsys):
    """An option with a concrete default says it in --help (what a new user needs to know
    that `llmq generate` samples at temperature 1, say)."""
    checked = 0
    for path, parser in _commands(build_parser()):
        with pytest.raises(SystemExit):
            main([*path, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        for action in parser._actions:
            unset = action.default in (None, False, [], "", argparse.SUPPRESS)
            if unset or not action.option_strings:
                continue
            checked += 1
            said = f"(default: {action.default})" in text or "default" in (action.help or "")
            assert said, f"llmq {' '.join(path)} --help hides {action.option_strings[-1]}'s default"
    assert checked >= 15  # the test walked the real commands


def test_version_comes_from_the_package_metadata(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"llmq {version('llmq')}"
