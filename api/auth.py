"""Bearer keys for /v1 (`LLMQ_API_KEYS`) and /admin (`LLMQ_ADMIN_KEY`, else loopback only).

Keys are compared in constant time and never logged.
"""

from __future__ import annotations

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
