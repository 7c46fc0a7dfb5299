"""Redis's wire format (RESP) for a worker's step write: commands packed in one pass, sent
and answered on one pooled connection.

A step's script call carries every job's keys and arguments (~16 per job: ~4,100 for 256
jobs). redis-py without hiredis packs each argument by joining it onto a growing buffer:
9.3 ms for that call, against 2.1 ms here (bench/redis_cost.py's 256 jobs, a 2-core EPYC),
CPU that the writer thread takes from the decode loop under the GIL.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

from workers.wire.loaded_script import LoadedScript

Arg = bytes | str | int | float


def pack(args: Sequence[Arg]) -> bytes:
    """One command as RESP: the array of its arguments as bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    add = out.append
    for arg in args:
        if type(arg) is bytes:
            data = arg
        elif type(arg) is str:
            data = arg.encode()
        else:
            data = repr(arg).encode()  # numbers as redis-py writes them
        add(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(out)


def round_trip(client: Any, commands: Sequence[bytes], replies: int) -> list[Any]:
    """Send packed `commands` on one connection of `client`'s pool and read `replies`
    replies, in order; an error reply comes back as its `ResponseError` (as a pipeline's
    `execute(raise_on_error=False)`), a broken connection raises (ConnectionError, ...)."""
    pool = client.connection_pool
    connection = pool.get_connection()
    try:
        connection.send_packed_command([b"".join(commands)])
        answers: list[Any] = []
        for _ in range(replies):
            try:
                answers.append(connection.read_response())
            except ResponseError as exc:  # read whole: the next reply follows
                answers.append(exc)
        return answers
    except BaseException:
        connection.disconnect()  # replies may be left unread on it
        raise
    finally:
        pool.release(connection)


def script_round_trip(
    client: Any,
    script: LoadedScript,
    keys: Sequence[Arg],
    args: Sequence[Arg],
    commands: Sequence[Sequence[Arg]] = (),
) -> Any:
    """`script` by its hash, then `commands`, in one round trip; the script's reply, any
    error reply raised. A NOSCRIPT reply (Redis lost its scripts: a restart, a failover) ran
    nothing, so the script is loaded and called alone again; `commands` ran once already."""
    call = ["EVALSHA", script.sha, len(keys), *keys, *args]
    packed = [pack(call), *(pack(command) for command in commands)]
    replies = round_trip(client, packed, len(packed))
    if isinstance(replies[0], NoScriptError):
        replies[0] = script(client, keys, args)
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies[0]
