"""Per-caller rate limits: `LLMQ_RATE_LIMIT_RPM` requests and `LLMQ_RATE_LIMIT_TPM` tokens
per minute for each API key (each client address when /v1 has no keys), shared by every
API process and machine through Redis: a token bucket per limit that refills continuously
(`workers.wire.rate_limit`), checked and charged by one script, one round trip. Unset or
0: that limit is off; with both off nothing here runs.

What counts. The POSTs that create work: completions, chat completions and embeddings
(sync, streamed or `Prefer: respond-async`) and `POST /v1/jobs` count 1 request and the
tokens they may use (`api.token_budget`: prompt + max_tokens, embeddings their input); the
job's end corrects that to its real usage (its worker's final write; for a job cancelled
while queued, the cancel). `POST /v1/batches` counts 1 request and no tokens: a batch's
lines run below interactive work and do not count against the per-minute limits (OpenAI
keeps batch limits apart too). Every other /v1 answer (reads and polls of jobs, files and
batches, uploads, cancels) counts nothing and carries the headers: polling a job must not
spend the budget that generating needs. /admin, /health, /ready, /metrics, the dashboard,
/docs and /openapi.json are never limited and carry no headers.

Refusals. Past a limit: 429 in OpenAI's shape (`type` "requests" or "tokens", `code`
"rate_limit_exceeded") with Retry-After, the whole seconds (>= 1) until the bucket has room;
nothing is taken. A request that needs more tokens than the whole TPM limit could never
pass: 400 `request_too_large` at once, not a 429 that clients would retry for nothing. A
request refused before it is charged (400, 404, 503) costs nothing; one refused after it
(the queue is full) is given back, and an `Idempotency-Key` repeat gives back its tokens
(the first job holds the reservation).

Headers. OpenAI's `x-ratelimit-limit-*`, `x-ratelimit-remaining-*` and
`x-ratelimit-reset-*` for `requests` and `tokens` (the trio of each limit that is on) on
every /v1 answer, 2xx, 202, streamed or error, as the caller's buckets stand after the
request: remaining is what is left now, reset the time until the bucket is full again, in
OpenAI's format (Go durations: `120ms`, `1s`, `1m30.5s`). An answer that did not charge
reads the buckets (one more round trip) without changing them. A 401 has no caller and
gets none.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import redis
from flask import Flask, Response, current_app, g, request

from api.auth import bearer_token, is_api_key, owner_of
from api.config import redis_conn
from api.errors import APIError, RateLimited, RequestTooLarge
from workers import keys
from workers.wire import rate_limit
from workers.wire.rate_limit import REQUESTS, TOKENS, WINDOW_MS, Charge, Reservation

log = logging.getLogger(__name__)

EXTENSION = "rate_limiter"
_NAMES = {REQUESTS: ("requests per min", "RPM"), TOKENS: ("tokens per min", "TPM")}


@dataclass(frozen=True)
class Admission:
    """What charging one request took from its caller's buckets: enough to give it back,
    and the tokens' reservation its job carries (None when no tokens were reserved)."""

    bucket: str
    requests: int
    reservation: Reservation | None

    @property
    def tokens(self) -> int:
        return 0 if self.reservation is None else self.reservation.tokens


class RateLimiter:
    """The per-minute limits (0: off) and the charges, looks and give-backs on a caller's
    buckets; held by the app (`app.extensions`) only while a limit is on."""

    def __init__(self, requests_per_minute: int, tokens_per_minute: int) -> None:
        self.limits = (requests_per_minute, tokens_per_minute)

    def charge(
        self, conn: redis.Redis, bucket: str, tokens: int, param: str = "max_tokens"
    ) -> tuple[Charge, Admission | APIError]:
        """Take one request and `tokens` from `bucket`: the buckets' figures after, and
        what was taken, or the refusal to raise (then nothing was taken); `param`: the field
        to lower when the tokens could never fit."""
        tpm = self.limits[1]
        tokens = tokens if tpm else 0
        if tokens > tpm > 0:
            return self.look(conn, bucket), RequestTooLarge(
                f"Request too large for tokens per min (TPM): Limit {tpm}, Requested {tokens} "
                "(prompt tokens and the most it may generate). It can never fit; lower "
                "max_tokens or shorten the prompt.",
                param=param,
            )
        charged = rate_limit.charge(conn, bucket, self.limits, (1, tokens))
        if charged.refused_by is not None:
            return charged, _refusal(charged, tokens)
        reservation = Reservation(bucket, tokens, WINDOW_MS / tpm) if tokens > 0 else None
        return charged, Admission(bucket, 1, reservation)

    def look(self, conn: redis.Redis, bucket: str) -> Charge:
        return rate_limit.charge(conn, bucket, self.limits, (0, 0))

    def give_back(self, conn: redis.Redis, admission: Admission, *, requests: bool) -> Charge:
        """Return `admission`'s tokens, and its request too if `requests`: the figures after."""
        back = (-admission.requests if requests else 0, -admission.tokens)
        return rate_limit.charge(conn, admission.bucket, self.limits, back)


def _refusal(charged: Charge, tokens: int) -> RateLimited:
    name = charged.refused_by or REQUESTS
    bucket = next(b for b in charged.buckets if b.name == name)
    words, short = _NAMES[name]
    wait = go_duration(charged.retry_after_ms)
    requested = 1 if name == REQUESTS else tokens
    return RateLimited(
        f"Rate limit reached for {words} ({short}): Limit {bucket.limit}, Used "
        f"{bucket.limit - bucket.remaining}, Requested {requested}. Please try again in {wait}.",
        limit=name,
        retry_after_s=max(1, math.ceil(charged.retry_after_ms / 1000)),
    )


def go_duration(ms: int) -> str:
    """A duration as OpenAI's headers write it (Go's `time.Duration`, to the ms): `0s`,
    `120ms`, `1s`, `8.64s`, `6m0s`, `1h0m0s`."""
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    minutes, ms_left = divmod(ms, 60_000)
    seconds = f"{ms_left // 1000}.{ms_left % 1000:03d}".rstrip("0").rstrip(".") + "s"
    if minutes == 0:
        return seconds
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes}m{seconds}" if hours else f"{minutes}m{seconds}"


def headers(charged: Charge) -> dict[str, str]:
    out = {}
    for bucket in charged.buckets:
        out[f"x-ratelimit-limit-{bucket.name}"] = str(bucket.limit)
        out[f"x-ratelimit-remaining-{bucket.name}"] = str(bucket.remaining)
        out[f"x-ratelimit-reset-{bucket.name}"] = go_duration(bucket.reset_ms)
    return out


# ---------------------------------------------------------------- the request's side


def limiter() -> RateLimiter | None:
    return current_app.extensions.get(EXTENSION)


def caller_bucket() -> str | None:
    """The bucket of this request's caller: its API key's (by digest, never the key), or
    its client address's when /v1 has no keys; None for a request without a valid key."""
    if not current_app.config["API_KEYS"]:
        return keys.rate_limit(f"addr:{request.remote_addr or 'unknown'}")
    token = bearer_token()
    if token is None or not is_api_key(token):
        return None
    return keys.rate_limit(f"key:{owner_of(token)}")


def admit(tokens: int = 0, param: str = "max_tokens") -> Admission | None:
    """Charge this request (1 request, `tokens` tokens) to its caller, or raise a 429 (or
    a 400 naming `param` for more tokens than the limit); None while no limit is on."""
    active = limiter()
    bucket = caller_bucket() if active is not None else None
    if active is None or bucket is None:
        return None
    charged, outcome = active.charge(redis_conn(), bucket, tokens, param)
    g.rate_limit = charged  # the headers show these figures, refused or not
    if isinstance(outcome, APIError):
        raise outcome
    return outcome


def give_back(admission: Admission | None, *, requests: bool) -> None:
    """Undo `admit` for a request refused after it was charged (`requests` True), or give
    back only the tokens of one whose work another job does. Never raises: the buckets
    refill within a minute anyway."""
    active = limiter()
    if admission is None or active is None:
        return
    try:
        g.rate_limit = active.give_back(redis_conn(), admission, requests=requests)
    except redis.RedisError as exc:
        log.warning("could not give back a rate-limit charge: %s", exc)


def token_limit() -> int:
    """The tokens-per-minute limit; 0 when it is off."""
    active = limiter()
    return 0 if active is None else active.limits[1]


def _add_headers(response: Response) -> Response:
    """after_request: the caller's figures on every /v1 answer."""
    if not (request.path == "/v1" or request.path.startswith("/v1/")):
        return response
    if response.status_code == 401 or g.get("broker_down"):
        return response
    charged = g.get("rate_limit")
    if charged is None:
        active, bucket = limiter(), caller_bucket()
        if active is None or bucket is None:
            return response
        try:
            charged = active.look(redis_conn(), bucket)
        except redis.RedisError as exc:
            log.warning("could not read rate-limit buckets: %s", exc)
            return response
    response.headers.update(headers(charged))
    return response


def install(app: Flask) -> None:
    """Hold a limiter and add the headers when `RATE_LIMIT_RPM` or `_TPM` is set; else
    nothing, so requests pay nothing for limits that are off."""
    rpm, tpm = app.config["RATE_LIMIT_RPM"], app.config["RATE_LIMIT_TPM"]
    if rpm <= 0 and tpm <= 0:
        return
    app.extensions[EXTENSION] = RateLimiter(max(rpm, 0), max(tpm, 0))
    app.after_request(_add_headers)
