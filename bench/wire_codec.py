"""What a job's token event costs to encode and decode: the current codec against msgspec.

    python bench/wire_codec.py [--number 20000] [--repeat 5]

Every token a job streams is built and encoded once by its worker
(`workers.wire.events.token_event`) and decoded by the API process that relays it
(`workers.wire.events.decode`, from the bytes redis-py returns). Per event, best of
`--repeat` runs of `--number` events, for a typical token (greedy, no logprobs) and one that
carries chat logprobs with 5 alternatives:

- `llmq`: the codec as shipped (a slots dataclass, stdlib `json`, `from_data`);
- `msgspec`: a `msgspec.Struct` of the same fields written as the same JSON object, decoded
  by its typed `Decoder` (only when msgspec is installed: it is not a dependency);
- `json dict`: the event's dict through `json.dumps` / `json.loads`, untyped: the floor.

Printed: microseconds to encode, to decode and both, and both as a share of a decode step
of 10 and 40 ms. The question it answers: is the codec a meaningful share of a token?
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import timeit
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.harness import commit, cpu_name  # noqa: E402
from workers.wire.events import EVENT_TOKEN, StreamToken, decode, token_event  # noqa: E402

STEP_MS = (10.0, 40.0)  # a decode step's time per token, small model to large


def _chat_logprobs(text: str) -> dict[str, Any]:
    """One item of a chat answer's `logprobs.content`, with 5 alternatives."""
    alternatives = [(text, -0.12), (" a", -2.3), (" this", -3.1), (" that", -3.4), (" an", -4.0)]
    return {
        "token": text,
        "logprob": -0.12,
        "bytes": list(text.encode()),
        "top_logprobs": [
            {"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in alternatives
        ],
    }


EVENTS: dict[str, dict[str, Any]] = {
    "typical token": {
        "choice": 0,
        "index": 41,
        "text": " the",
        "token_id": 279,
        "logprob": None,
        "finish_reason": None,
        "attempt": 1,
    },
    "token + logprobs (top 5)": {
        "choice": 0,
        "index": 41,
        "text": " the",
        "token_id": 279,
        "logprob": -0.12,
        "finish_reason": None,
        "attempt": 1,
        "logprobs": _chat_logprobs(" the"),
        "top_logprobs": [(279, -0.12), (264, -2.3), (420, -3.1), (430, -3.4), (459, -4.0)],
    },
}

Codec = tuple[Callable[[], Any], Callable[[], Any], bytes]  # encode, decode, the bytes on the wire


def entry(kind: str, data: bytes) -> dict[bytes, bytes]:
    """A stream entry's fields as redis-py's XREAD returns them."""
    return {b"event": kind.encode(), b"data": data}


def llmq_codec(args: dict[str, Any]) -> Codec:
    kind, data = token_event(**args)
    fields = entry(kind, data.encode())
    return lambda: token_event(**args), lambda: decode(fields), data.encode()


def json_dict_codec(args: dict[str, Any]) -> Codec:
    data = StreamToken(**{**args, "top_logprobs": tuple(args.get("top_logprobs", ()))}).to_data()
    raw = json.dumps(data, ensure_ascii=False).encode()
    return lambda: json.dumps(data, ensure_ascii=False), lambda: json.loads(raw), raw


def msgspec_codec(args: dict[str, Any]) -> Codec | None:
    """The same event as a `msgspec.Struct`; None when msgspec is not installed."""
    try:
        import msgspec
    except ImportError:
        return None

    # fields in the order `StreamToken.to_data` writes them; the last two left out when None
    class Token(msgspec.Struct, omit_defaults=True):
        choice: int
        index: int
        text: str
        token_id: int
        logprob: float | None
        top_logprobs: list[tuple[int, float]]
        finish_reason: str | None
        attempt: int
        logprobs: dict[str, Any] | None = None
        delta: dict[str, Any] | None = None

    encoder, decoders = msgspec.json.Encoder(), {EVENT_TOKEN: msgspec.json.Decoder(Token)}
    full = {"top_logprobs": [], "logprobs": None, "delta": None, **args}
    fields = entry(EVENT_TOKEN, encoder.encode(Token(**full)))

    def encode() -> bytes:
        return encoder.encode(Token(**full))

    def decode_entry() -> Any:
        return decoders[fields[b"event"].decode()].decode(fields[b"data"])

    return encode, decode_entry, fields[b"data"]


def per_event_us(fn: Callable[[], Any], number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def measure(codec: Codec, number: int, repeat: int) -> dict[str, Any]:
    encode, decode_entry, wire = codec
    return {
        "encode_us": per_event_us(encode, number, repeat),
        "decode_us": per_event_us(decode_entry, number, repeat),
        "bytes": len(wire),
        "object": json.loads(wire),
    }


def render(rows: list[tuple[str, str, dict[str, Any]]], header: str) -> str:
    steps = " | ".join(f"of a {ms:g} ms step" for ms in STEP_MS)
    lines = [
        header,
        "",
        f"| event | codec | encode us | decode us | both us | {steps} | bytes |",
        "| --- | --- | --- | --- | --- |" + " --- |" * len(STEP_MS) + " --- |",
    ]
    for event, codec, r in rows:
        both = r["encode_us"] + r["decode_us"]
        shares = " | ".join(f"{both / (ms * 1000):.3%}" for ms in STEP_MS)
        lines.append(
            f"| {event} | {codec} | {r['encode_us']:.2f} | {r['decode_us']:.2f} | {both:.2f} "
            f"| {shares} | {r['bytes']} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=20_000, help="events per timed run")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs; the best is kept")
    args = parser.parse_args(argv)
    try:
        import msgspec

        versions = f"msgspec {msgspec.__version__}"
    except ImportError:
        versions = "msgspec not installed"
        print("msgspec is not installed (pip install msgspec to measure it); measuring the rest")
    rows = []
    for event, fields in EVENTS.items():
        codecs = {
            "llmq": llmq_codec(fields),
            "msgspec": msgspec_codec(fields),
            "json dict": json_dict_codec(fields),
        }
        results = {
            name: measure(codec, args.number, args.repeat)
            for name, codec in codecs.items()
            if codec is not None
        }
        # the same JSON object on the wire, whatever the codec (older readers parse it)
        assert all(r["object"] == results["llmq"]["object"] for r in results.values()), event
        rows += [(event, name, r) for name, r in results.items()]
    header = (
        f"cpu: {cpu_name()}, {os.cpu_count()} cores; python {platform.python_version()}; "
        f"{versions}; commit {commit()}; best of {args.repeat} runs of {args.number} events; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(render(rows, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
