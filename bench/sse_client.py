"""A lean streaming HTTP/1.1 client for the benches that hold many SSE streams at once.

The relay benches measure the API, not the client, yet their clients share the API's cores:
httpx's async client spent more CPU per token than the API relaying it (bench/fleet.py at
1,000 streams on 2 cores). This one speaks only what those benches need: one POST per
connection with a JSON body, the status line and headers, then the chunked body (gunicorn
sends each write as a chunk), handed out as the bytes of each chunk.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any


class HTTPStreamError(Exception):
    """The response broke off or was not HTTP/1.1 as gunicorn sends it."""


def post_request(host: str, path: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + data


class StreamedResponse:
    """One POST's response: `status`, `headers` (lower-cased names), then `chunks()`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.status = 0
        self.headers: dict[str, str] = {}

    @classmethod
    async def post(cls, host: str, port: int, path: str, body: dict[str, Any]) -> StreamedResponse:
        reader, writer = await asyncio.open_connection(host, port, limit=2**20)
        response = cls(reader, writer)
        try:
            writer.write(post_request(f"{host}:{port}", path, body))
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
        except (OSError, asyncio.IncompleteReadError) as exc:
            response.close()
            raise HTTPStreamError(f"no response: {type(exc).__name__}") from exc
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[1].isdigit():
            response.close()
            raise HTTPStreamError(f"not an HTTP status line: {lines[0][:80]!r}")
        response.status = int(parts[1])
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                response.headers[name.strip().lower()] = value.strip()
        return response

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive: each chunk of a chunked body, else what the
        socket gives until it closes (or Content-Length is read)."""
        try:
            if self.headers.get("transfer-encoding", "").lower() == "chunked":
                while True:
                    size_line = await self.reader.readuntil(b"\r\n")
                    size = int(size_line.split(b";", 1)[0], 16)
                    if size == 0:
                        return
                    data = await self.reader.readexactly(size + 2)
                    yield data[:-2]
            elif "content-length" in self.headers:
                yield await self.reader.readexactly(int(self.headers["content-length"]))
            else:
                while data := await self.reader.read(65536):
                    yield data
        except (OSError, ValueError, asyncio.IncompleteReadError) as exc:
            raise HTTPStreamError(f"the body broke off: {type(exc).__name__}") from exc

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.chunks()])

    def close(self) -> None:
        self.writer.close()
