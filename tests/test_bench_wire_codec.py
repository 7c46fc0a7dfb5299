"""bench/wire_codec.py runs, with and without msgspec, and measures the codec as shipped:
its encoder and decoder write and read the event JSON the stream holds."""

from __future__ import annotations

import json
import sys

import pytest

from bench import wire_codec


def test_the_bench_measures_the_shipped_codec(capsys) -> None:
    assert wire_codec.main(["--number", "20", "--repeat", "1"]) == 0
    table = capsys.readouterr().out
    for event in wire_codec.EVENTS:
        assert f"| {event} | llmq |" in table and f"| {event} | json dict |" in table


def test_without_msgspec_it_says_so_and_measures_the_rest(capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "msgspec", None)  # `import msgspec` raises ImportError
    assert wire_codec.main(["--number", "20", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "msgspec is not installed" in out
    assert "| msgspec |" not in out and "| llmq |" in out


@pytest.mark.parametrize("event", list(wire_codec.EVENTS))
def test_the_llmq_codec_round_trips_each_event(event) -> None:
    encode, decode, wire = wire_codec.llmq_codec(wire_codec.EVENTS[event])
    assert encode()[1].encode() == wire
    assert decode().to_data() == json.loads(wire)
