"""The step write's own RESP packing: byte for byte what redis-py sends, and one round trip
whose error replies come back in place, against real Redis."""

from __future__ import annotations

import pytest
import redis
from redis.exceptions import ResponseError

from workers import resp

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    "args",
    [
        ("SET", "k", "v"),
        ("HINCRBYFLOAT", "h", "f", 0.1 + 0.2),
        ("XADD", "s", "*", "data", '{"text": "é€😀"}', b"\x00raw\r\n", 7, -3),
    ],
)
def test_pack_writes_what_redis_py_writes(conn, args):
    connection = conn.connection_pool.get_connection()
    try:
        assert resp.pack(args) == b"".join(connection.pack_commands([args]))
    finally:
        conn.connection_pool.release(connection)


def test_a_round_trip_answers_every_command_in_order_errors_in_place(conn):
    commands = [
        resp.pack(["SET", "k", "é"]),
        resp.pack(["INCR", "k"]),  # not an integer: an error reply
        resp.pack(["GET", "k"]),
    ]
    set_reply, error, value = resp.round_trip(conn, commands, 3)
    assert set_reply in (True, b"OK") and isinstance(error, ResponseError)
    assert value == "é".encode()
    assert conn.ping()  # the connection went back to the pool in step with its replies


def test_a_round_trip_to_no_redis_raises_a_connection_error(conn):
    dead = redis.Redis(port=1, socket_connect_timeout=0.5)
    with pytest.raises(redis.ConnectionError):
        resp.round_trip(dead, [resp.pack(["PING"])], 1)
