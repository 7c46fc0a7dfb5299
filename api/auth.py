"""Bearer keys for /v1 (`LLMQ_API_KEYS`) and /admin (`LLMQ_ADMIN_KEY`, else loopback only).

Keys are compared in constant time and never logged. With `LLMQ_API_KEYS` set, the files,
batches and jobs a key creates are its own: they carry the key's digest (`owner_of`, never
the key itself) and a caller with another key is told they do not exist (404). Without
keys nothing is scoped.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress

from flask import current_app, request

from api.errors import AuthenticationFailed, PermissionDenied


def bearer_token() -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _matches(token: str, candidates: tuple[str, ...]) -> bool:
    found = False
    for key in candidates:  # no early exit: timing says nothing about which key matched
        found |= hmac.compare_digest(token.encode(), key.encode())
    return found


OWNER_DIGEST_KEY = b"llmq owner v1"  # a digest made for owners is no use anywhere else


def owner_of(token: str) -> str:
    """What Redis keeps of the API key that created an object: a keyed SHA-256 digest."""
    return hmac.new(OWNER_DIGEST_KEY, token.encode(), hashlib.sha256).hexdigest()[:32]


def caller_scope() -> str | None:
    """The owner digest of this request's API key, or None when /v1 is open (no
    `LLMQ_API_KEYS`): then objects are neither stamped nor filtered."""
    if not current_app.config["API_KEYS"]:
        return None
    token = bearer_token()
    if token is None:  # require_api_key lets no such request through; never widen the scope
        raise AuthenticationFailed("Missing API key: send it as 'Authorization: Bearer YOUR_KEY'.")
    return owner_of(token)


def visible(owner: str | None, scope: str | None) -> bool:
    """Whether a caller of `scope` may see an object of `owner`. Unscoped callers see
    everything; objects made while /v1 was open (no owner) are everyone's."""
    return scope is None or owner is None or hmac.compare_digest(owner, scope)


def is_api_key(token: str) -> bool:
    """Whether `token` is one of `LLMQ_API_KEYS` (compared in constant time)."""
    return _matches(token, current_app.config["API_KEYS"])


def require_api_key() -> None:
    """before_request for /v1: a no-op unless LLMQ_API_KEYS is set."""
    keys: tuple[str, ...] = current_app.config["API_KEYS"]
    if not keys:
        return
    token = bearer_token()
    if token is None:
        raise AuthenticationFailed("Missing API key: send it as 'Authorization: Bearer YOUR_KEY'.")
    if not _matches(token, keys):
        raise AuthenticationFailed("Incorrect API key provided.")


def require_admin() -> None:
    """before_request for /admin: the admin key, or loopback when no admin key is set."""
    admin_key: str | None = current_app.config["ADMIN_KEY"]
    if admin_key is None:
        if not _is_loopback(request.remote_addr):
            raise PermissionDenied(
                "/admin is served on loopback only; set LLMQ_ADMIN_KEY to use it remotely."
            )
        return
    token = bearer_token()
    if token is not None and _matches(token, (admin_key,)):
        return
    if token is not None and _matches(token, current_app.config["API_KEYS"]):
        raise PermissionDenied("This API key cannot use /admin; use the admin key.")
    raise AuthenticationFailed("The admin key is required for /admin.")


def _is_loopback(addr: str | None) -> bool:
    try:
        return addr is not None and ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False
