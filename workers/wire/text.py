"""Redis replies are bytes unless the client decodes them; records are read either way."""

from __future__ import annotations

from collections.abc import Mapping


def as_str(value: bytes | str) -> str:
    """`value` as str (UTF-8 when it is bytes)."""
    return value.decode() if isinstance(value, bytes) else value


def text_hash(raw: Mapping[bytes | str, bytes | str]) -> dict[str, str]:
    """A Redis hash (HGETALL) with str keys and values."""
    return {as_str(k): as_str(v) for k, v in raw.items()}


def optional_float(value: str | None) -> float | None:
    return None if value is None else float(value)


def optional_int(value: float | None) -> int | None:
    return None if value is None else int(value)
