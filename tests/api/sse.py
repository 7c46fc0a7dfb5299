"""A small SSE parser for tests (fields per the WHATWG event-stream format)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class Message:
    event: str | None
    id: str | None
    data: str
    comments: list[str]
    retry: int | None = None

    def json(self) -> Any:
        return json.loads(self.data)


def parse(lines: Iterable[str]) -> Iterator[Message]:
    fields: dict[str, Any] = {"event": None, "id": None, "data": [], "comments": [], "retry": None}
    seen = False
    for line in lines:
        line = line.rstrip("\r\n")
        if not line:
            if seen:
                yield Message(
                    fields["event"],
                    fields["id"],
                    "\n".join(fields["data"]),
                    fields["comments"],
                    fields["retry"],
                )
            fields = {"event": None, "id": None, "data": [], "comments": [], "retry": None}
            seen = False
            continue
        seen = True
        if line.startswith(":"):
            fields["comments"].append(line[1:].strip())
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            fields["data"].append(value)
        elif name == "retry":
            fields["retry"] = int(value)
        elif name in ("event", "id"):
            fields[name] = value


def parse_text(text: str) -> list[Message]:
    return list(parse(text.split("\n")))
