"""bench/broker.py: a bench measures through a real redis-server unless told otherwise, names
its broker, and marks every table printed from fakeredis's server."""

from __future__ import annotations

import argparse
import json

import pytest
import redis

from bench import broker as bench_broker
from bench import harness
from workers.redis_server import RedisServerMissing, find_redis_server
from workers.supervisor import free_port


def parse(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="bench")
    bench_broker.add_broker_args(p)
    return p, p.parse_args(argv)


def test_without_a_redis_server_a_bench_refuses_to_run_and_names_the_flag(monkeypatch, capsys):
    def missing() -> None:
        raise RedisServerMissing("no redis-server on PATH and none installed with llmq")

    monkeypatch.setattr(bench_broker, "find_redis_server", missing)
    p, args = parse([])
    with pytest.raises(SystemExit) as exited:
        bench_broker.broker_from_args(p, args)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "no redis-server on PATH" in err and "--fake-broker" in err


def test_a_fake_broker_is_used_only_when_asked_and_says_so():
    p, args = parse(["--fake-broker"])
    chosen = bench_broker.broker_from_args(p, args)
    assert chosen.fake and bench_broker.FAKE_MARK in chosen.describe()
    running = chosen.start(free_port())
    try:
        assert redis.Redis.from_url(running.url).ping()
    finally:
        running.stop()
    with pytest.raises(SystemExit):
        bench_broker.broker_from_args(*parse(["--fake-broker", "--redis-url", "redis://x"]))


@pytest.mark.integration
def test_by_default_a_bench_starts_the_real_redis_server_and_names_it():
    p, args = parse([])
    chosen = bench_broker.broker_from_args(p, args)
    binary = find_redis_server()
    assert not chosen.fake and chosen.describe() == binary.describe()
    running = chosen.start(free_port(), ("--hz", "100"))
    try:
        conn = redis.Redis.from_url(running.url)
        assert conn.info("server")["redis_version"] == binary.version_text
        assert conn.config_get("hz") == {"hz": "100"}
        external = bench_broker.ExternalRedis.at(running.url.replace("//", "//:secret@"))
        assert external.describe() == (
            f"Redis {binary.version_text} at redis://:***@127.0.0.1:{running.url.split(':')[2]}"
            " (--redis-url)"
        )
    finally:
        running.stop()


@pytest.fixture(autouse=True)
def keep_sigterm(monkeypatch):
    """run_script's SIGTERM handler is for a bench's own process, not pytest's."""
    monkeypatch.setattr(harness, "stop_cleanly_on_sigterm", lambda: None)


def test_every_table_printed_from_a_fake_broker_says_so_in_its_title(capsys, tmp_path):
    table = "first table\n  row 1\n\nsecond table\n  row 2\n\n\nthird table"
    args = argparse.Namespace(child=None, json=tmp_path / "raw.json")
    args.broker = bench_broker.FakeRedis()
    harness.run_script(args, {}, lambda _: {"meta": {"steps": 3}}, lambda _: table)
    printed = capsys.readouterr().out.splitlines()
    titles = [line for line in printed if line.endswith("table")]
    assert len(titles) == 3
    assert all(title.startswith(bench_broker.FAKE_MARK) for title in titles)
    assert not any(line.startswith(bench_broker.FAKE_MARK) for line in printed if "row" in line)
    raw = json.loads(args.json.read_text())
    assert raw["meta"]["fake_broker"] is True and raw["meta"]["steps"] == 3
    assert raw["meta"]["broker"] == args.broker.describe()


def test_a_real_broker_leaves_the_tables_as_they_are(capsys):
    args = argparse.Namespace(child=None, json=None, broker=None)
    harness.run_script(args, {}, lambda _: {}, lambda raw: f"table\nbroker {raw['meta']['broker']}")
    assert capsys.readouterr().out == "table\nbroker None\n"
