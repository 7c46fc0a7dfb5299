"""One webhook delivery: the RQ job function `deliver`, run by `llmq webhooks`.

Signed as Standard Webhooks says (the `standardwebhooks` package): `webhook-id` (the event's
id), `webhook-timestamp`, `webhook-signature` = `v1,` + base64 HMAC-SHA256 of
`id.timestamp.body` under the secret's base64 part. POSTed once per attempt, with a timeout
(`LLMQ_WEBHOOK_TIMEOUT_SECONDS`), no redirect followed (a 3xx is a failure), only a 2xx a
success; anything else raises, and RQ's `Retry` schedules the next attempt.

Server-side request forgery: the URL's host is resolved here and every address checked;
loopback, link-local, private, multicast, reserved, unspecified and other non-global
addresses (IPv4, IPv6, IPv4-mapped IPv6) are refused unless `LLMQ_WEBHOOK_ALLOW` names the
host or a CIDR holding the address. The POST then connects to the address that was checked
(the URL's host only in the Host header and TLS's server name), so a DNS answer that
changes between the check and the connect cannot move it.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import urllib3
from rq import get_current_job
from standardwebhooks.webhooks import Webhook

from workers.errors import WorkerError
from workers.wire.webhook_jobs import WebhookSettings
from workers.wire.webhooks import DeliveryAttempt, get_endpoint, log_delivery

log = logging.getLogger("llmq.webhooks")

MAX_RESPONSE_BYTES = 64 * 1024  # read of a receiver's answer: its status is what counts
USER_AGENT = "llmq-webhooks"

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class DeliveryFailed(WorkerError):
    """This attempt did not get a 2xx; RQ retries it (or files it as dead after the last)."""


class AddressRefused(DeliveryFailed):
    """The URL's host resolves only to addresses a webhook may not reach."""


@dataclass(frozen=True)
class Target:
    scheme: str
    host: str  # as the URL names it (Host header, TLS server name)
    address: str  # the checked IP the connection goes to
    port: int
    path: str


def is_forbidden(address: IPAddress) -> bool:
    """Not a public unicast address (an IPv4-mapped IPv6 address is judged as its IPv4)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return (
        address.is_loopback
        or address.is_link_local
        or address.is_private
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
        or not address.is_global
    )


def is_allowed(host: str, address: IPAddress, allow: tuple[str, ...]) -> bool:
    """Whether `LLMQ_WEBHOOK_ALLOW` names the host or a network holding the address."""
    mapped = address
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        mapped = address.ipv4_mapped
    for entry in allow:
        try:
            network = ipaddress.ip_network(entry, strict=False)
        except ValueError:
            if entry.lower().rstrip(".") == host.lower().rstrip("."):
                return True
            continue
        if address in network or mapped in network:
            return True
    return False


def resolve(url: str, allow: tuple[str, ...] = ()) -> Target:
    """The address to POST `url` to: the first one its host resolves to that a webhook may
    reach; `AddressRefused` if there is none."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise DeliveryFailed(f"cannot resolve {host!r}: {exc}") from None
    refused = []
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        if is_forbidden(address) and not is_allowed(host, address, allow):
            refused.append(str(address))
            continue
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return Target(parts.scheme, host, str(address), port, path)
    raise AddressRefused(
        f"{host!r} resolves to {', '.join(refused)}: not a public address "
        "(LLMQ_WEBHOOK_ALLOW may name it)"
    )


def signed_headers(secret: str, event_id: str, body: str, at: float) -> dict[str, str]:
    """The Standard Webhooks headers of one attempt."""
    timestamp = datetime.fromtimestamp(int(at), tz=UTC)
    return {
        "webhook-id": event_id,
        "webhook-timestamp": str(int(at)),
        "webhook-signature": Webhook(secret).sign(event_id, timestamp, body),
        "content-type": "application/json",
        "user-agent": USER_AGENT,
    }


def post(target: Target, headers: dict[str, str], body: bytes, timeout: float) -> int:
    """POST to the checked address, the URL's host named only in Host and TLS's SNI;
    the receiver's status (a redirect is returned as is, never followed)."""
    default_port = 443 if target.scheme == "https" else 80
    host_header = target.host if target.port == default_port else f"{target.host}:{target.port}"
    if ":" in target.host and not target.host.startswith("["):
        host_header = f"[{target.host}]" + (
            "" if target.port == default_port else f":{target.port}"
        )
    kwargs: dict[str, Any] = {
        "timeout": urllib3.Timeout(total=timeout),
        "retries": False,
        "maxsize": 1,
    }
    if target.scheme == "https":
        pool: Any = urllib3.HTTPSConnectionPool(
            target.address,
            target.port,
            server_hostname=target.host,
            assert_hostname=target.host,
            cert_reqs="CERT_REQUIRED",
            **kwargs,
        )
    else:
        pool = urllib3.HTTPConnectionPool(target.address, target.port, **kwargs)
    try:
        response = pool.urlopen(
            "POST",
            target.path,
            body=body,
            headers={**headers, "host": host_header},
            redirect=False,
            retries=False,
            preload_content=False,
            assert_same_host=False,
        )
        try:
            response.read(MAX_RESPONSE_BYTES)
        finally:
            response.release_conn()
        return int(response.status)
    finally:
        pool.close()


def attempt_number(job: Any) -> int:
    """Which attempt of its delivery this run is (1 for the first)."""
    if job is None:
        return 1
    attempts = int(job.meta.get("attempts", 1))
    return max(1, attempts - int(job.retries_left or 0))


def deliver(endpoint_id: str, event: dict[str, Any], outbox_ms: int = 0) -> dict[str, Any]:
    """The RQ job: one attempt to deliver `event` to the endpoint; raises `DeliveryFailed`
    unless the receiver answered 2xx. Every attempt goes to the endpoint's delivery log."""
    job = get_current_job()
    conn = job.connection if job is not None else None
    settings = WebhookSettings.from_env()
    endpoint = get_endpoint(conn, endpoint_id) if conn is not None else None
    if endpoint is None:
        log.info("delivery of %s: endpoint %s was deleted; dropped", event.get("id"), endpoint_id)
        return {"dropped": "endpoint deleted"}
    body = json.dumps(event, separators=(",", ":"))
    started = time.time()
    status, error = None, None
    try:
        target = resolve(endpoint.url, settings.allow)
        headers = signed_headers(endpoint.secret, event["id"], body, time.time())
        status = post(target, headers, body.encode(), settings.timeout)
        if not 200 <= status < 300:
            error = f"HTTP {status}" + (
                " (redirects are not followed)" if 300 <= status < 400 else ""
            )
    except DeliveryFailed as exc:
        error = str(exc)
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:300]
    ms = (time.time() - started) * 1000
    attempt = DeliveryAttempt(
        delivery=job.id if job is not None else "",
        event_id=event["id"],
        type=event["type"],
        attempt=attempt_number(job),
        status=status,
        error=error,
        ms=round(ms, 2),
        at=started,
    )
    if conn is not None:
        log_delivery(conn, endpoint_id, attempt)
    if error is not None:
        log.info("delivery %s attempt %d: %s", attempt.delivery, attempt.attempt, error)
        raise DeliveryFailed(f"{endpoint.url}: {error}")
    return {"status": status, "ms": attempt.ms, "outbox_ms": outbox_ms}
