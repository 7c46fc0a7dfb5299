"""A Lua script called by its hash, shared by the API's submission gate (api/gate.py) and
the worker's scripts (workers/scripts.py): their text is kilobytes, which EVAL would send
and Redis hash again on every call (bench/redis_cost.py)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import NoScriptError


class LoadedScript:
    """A script called by its SHA1 (EVALSHA), loaded again when Redis has lost it (NOSCRIPT,
    after a restart or a failover): what redis-py's `register_script` does for a client, but
    also usable in a pipeline without its SCRIPT EXISTS round trip before every execute."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    def __call__(self, client: Any, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """Call on a client (not a pipeline), loading the script if Redis lacks it."""
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            self.load(client)
            return client.evalsha(self.sha, len(keys), *keys, *args)

    def queue(self, pipe: Any, keys: Sequence[Any], args: Sequence[Any]) -> None:
        """Add the call to a pipeline; its NOSCRIPT reply comes back from
        `execute(raise_on_error=False)` for the caller to `load` and call again."""
        pipe.evalsha(self.sha, len(keys), *keys, *args)

    def before(
        self, client: Any, keys: Sequence[Any], args: Sequence[Any], then: Callable[[Any], None]
    ) -> list[Any]:
        """The call and the commands `then` adds behind it, in one pipeline; their replies,
        error replies among them, not raised. A NOSCRIPT reply ran nothing: the script is
        loaded and all sent again, once (what follows it, as a WAIT, belongs to the call)."""

        def send() -> list[Any]:
            with client.pipeline(transaction=False) as pipe:
                self.queue(pipe, keys, args)
                then(pipe)
                return pipe.execute(raise_on_error=False)

        replies = send()
        if isinstance(replies[0], NoScriptError):
            self.load(client)
            replies = send()
        return replies

    def load(self, client: Any) -> None:
        client.script_load(self.text)
