"""Who may read the operator's /metrics: a bearer token the API server vouches for.

The same two questions controller-runtime's secure metrics server asks: a TokenReview (who is
this token?), then a SubjectAccessReview (may they `get` the non-resource URL `/metrics`?).
Answers are cached for a short while, keyed by a hash of the token, so a scrape every 15 s
costs the API server no more than two reviews a minute per scraper. The reviews create no
stored object: they are questions, not state, and a standby answers them as well.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

#: How long an answer is reused: an allowed token, and a refused or unknown one.
ALLOWED_TTL = 60.0
DENIED_TTL = 10.0
#: Distinct tokens remembered at once (scrapers are few; the bound keeps junk from growing it).
CACHE_SIZE = 256

OK, UNAUTHORIZED, FORBIDDEN = 200, 401, 403


@dataclass(frozen=True)
class Verdict:
    """The HTTP status a scrape gets, and why, for the log."""

    status: int
    reason: str


class ReviewApi(Protocol):
    """POST a review object to the API server and return its answer."""

    async def review(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create `body` at `path` (a TokenReview or SubjectAccessReview)."""
        ...


TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"


class MetricsAuth:
    """Authenticate and authorize one scrape's `Authorization: Bearer` header."""

    def __init__(self, api: ReviewApi, path: str = "/metrics",
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.api, self.path, self.clock = api, path, clock
        self._cache: OrderedDict[str, tuple[float, Verdict]] = OrderedDict()

    async def check(self, authorization: str | None) -> Verdict:
        """The verdict for one request's Authorization header."""
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return Verdict(UNAUTHORIZED, "no bearer token")
        key = hashlib.sha256(token.encode()).hexdigest()
        now = self.clock()
        cached = self._cache.get(key)
        if cached is not None and cached[0] > now:
            self._cache.move_to_end(key)
            return cached[1]
        verdict = await self._review(token)
        ttl = ALLOWED_TTL if verdict.status == OK else DENIED_TTL
        self._cache[key] = (now + ttl, verdict)
        self._cache.move_to_end(key)
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return verdict

    async def _review(self, token: str) -> Verdict:
        answer = await self.api.review(TOKEN_REVIEWS, {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
            "spec": {"token": token},
        })  # fmt: skip
        status = answer.get("status") or {}
        if not status.get("authenticated"):
            return Verdict(UNAUTHORIZED, str(status.get("error") or "token not authenticated"))
        user = status.get("user") or {}
        name = str(user.get("username") or "")
        access = await self.api.review(ACCESS_REVIEWS, {
            "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
            "spec": {
                "user": name, "groups": user.get("groups") or [], "uid": user.get("uid") or "",
                "extra": user.get("extra") or {},
                "nonResourceAttributes": {"path": self.path, "verb": "get"},
            },
        })  # fmt: skip
        allowed = (access.get("status") or {}).get("allowed")
        if not allowed:
            return Verdict(FORBIDDEN, f"{name} may not get {self.path}")
        return Verdict(OK, name)


class ApiClientReviews:
    """ReviewApi over kubernetes_asyncio's REST client (the operator's own credentials)."""

    def __init__(self, api: Any, timeout: float = 5.0) -> None:
        self.api, self.timeout = api, timeout

    async def review(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create the review; the API server answers it without storing anything."""
        answer: dict[str, Any] = await self.api.call_api(
            path, "POST", header_params={"Accept": "application/json",
                                         "Content-Type": "application/json"},
            body=body, response_types_map={200: "object", 201: "object"},
            auth_settings=["BearerToken"], _return_http_data_only=True,
            _request_timeout=self.timeout,
        )  # fmt: skip
        return answer
