"""What the launcher's middlewares in front of vLLM share (`--middleware` of vllm serve): the
ASGI types, the request path as vLLM routes it, and the operator's Ray token check."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

#: The header the operator sends its Ray token in (vllm_dp_operator.constants.RAY_AUTH_HEADER).
TOKEN_HEADER = b"x-ray-authorization"


def normal_path(path: str) -> str:
    """The path with one leading slash and no trailing one."""
    return "/" + path.lstrip("/").rstrip("/")


def carries_token(headers: Iterable[tuple[bytes, bytes]], token: str) -> bool:
    """Whether the request carries `Bearer <token>` in TOKEN_HEADER (never with no token)."""
    given = b"".join(v for k, v in headers if k.lower() == TOKEN_HEADER)
    return bool(token) and hmac.compare_digest(given, f"Bearer {token}".encode())
