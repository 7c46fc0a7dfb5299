"""`llmq api`: its parser and the gunicorn command it execs."""

from __future__ import annotations

import argparse
import sys

import pytest

from api.cli import CONF, add_api_commands, gunicorn_argv


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="llmq")
    add_api_commands(top.add_subparsers(dest="command"))
    return top


def test_defaults_come_from_host_and_port(monkeypatch) -> None:
    monkeypatch.setenv("HOST", "0.0.0.0")
    monkeypatch.setenv("PORT", "9123")
    args = parser().parse_args(["api"])
    assert (args.host, args.port, args.workers) == ("0.0.0.0", 9123, 2)


def test_gunicorn_command() -> None:
    args = parser().parse_args(["api", "--host", "127.0.0.1", "--port", "8001", "--workers", "3"])
    argv = gunicorn_argv(args)
    assert argv[:3] == [sys.executable, "-m", "gunicorn"]
    assert argv[argv.index("-c") + 1] == str(CONF) and CONF.is_file()
    assert argv[argv.index("-b") + 1] == "127.0.0.1:8001"
    assert argv[argv.index("-w") + 1] == "3"
    assert argv[-1] == "api.app:create_app()"


def test_help(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parser().parse_args(["api", "--help"])
    assert exit_info.value.code == 0
    assert "--workers" in capsys.readouterr().out


def test_gunicorn_config_loads(monkeypatch) -> None:
    import runpy

    monkeypatch.setenv("PORT", "8555")
    conf = runpy.run_path(str(CONF))
    assert conf["worker_class"] == "api.gevent_worker.StreamingWorker"
    assert conf["worker_connections"] >= 5000  # streams per process (bench/streams.py)
    assert conf["bind"].endswith(":8555")
    assert conf["limit_request_line"] <= 8190


def test_an_api_process_freezes_what_it_loaded_and_collects_young_objects_less_often() -> None:
    """api/gunicorn_conf.py post_worker_init, run as gunicorn runs it once the app is loaded
    (in a process of its own: it changes the interpreter's collector)."""
    import subprocess

    script = (
        "import gc, runpy, sys\n"
        f"conf = runpy.run_path({str(CONF)!r})\n"
        "from api.app import create_app\n"
        "create_app()\n"
        "before = gc.get_threshold()[0]\n"
        "conf['post_worker_init'](None)\n"
        "print(before, gc.get_threshold()[0], gc.get_freeze_count(), conf['GC_YOUNG_THRESHOLD'])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    before, after, frozen, wanted = map(int, done.stdout.split())
    assert before == 700 and after == wanted > before
    assert frozen > 10_000  # the app's modules and objects, out of every collection
