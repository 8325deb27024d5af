"""Who may read the operator's /metrics: a bearer token the API server vouches for.

The same two questions controller-runtime's secure metrics server asks: a TokenReview (who is
this token?), then a SubjectAccessReview (may they `get` the non-resource URL `/metrics`?).
Answers are cached for a short while, keyed by a hash of the token, so a scrape every 15 s
costs the API server no more than two reviews a minute per scraper. The reviews create no
stored object: they are questions, not state, and a standby answers them as well.

Anyone who reaches the port may send tokens, so junk must cost neither the scrapers nor the
API server: an allowed answer is kept apart from refusals (a flood of junk tokens evicts no
scraper's), and reviews of tokens not in the cache are limited to a few a second (past that,
429 with no review). `audiences`: the TokenReview asks that the token was issued for one of
these (a projected token made for the operator's metrics), and refuses it otherwise; empty,
the API server's own audiences, as a ServiceAccount's default token has.
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
#: Distinct tokens remembered at once (scrapers are few; the bound keeps junk from growing it),
#: refused ones and allowed ones apart.
CACHE_SIZE = 256
ALLOWED_SIZE = 64
#: Reviews of tokens not in the cache: this many a second on average, bursts of REVIEW_BURST.
REVIEWS_PER_SECOND = 5.0
REVIEW_BURST = 20

OK, UNAUTHORIZED, FORBIDDEN, TOO_MANY = 200, 401, 403, 429


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
                 clock: Callable[[], float] = time.monotonic,
                 audiences: tuple[str, ...] = ()) -> None:  # fmt: skip
        self.api, self.path, self.clock, self.audiences = api, path, clock, audiences
        #: Refused tokens' answers, and allowed ones' (junk never evicts a scraper's).
        self._cache: OrderedDict[str, tuple[float, Verdict]] = OrderedDict()
        self._allowed: OrderedDict[str, tuple[float, Verdict]] = OrderedDict()
        #: The review budget's tokens and when it was last filled.
        self._budget, self._filled = float(REVIEW_BURST), clock()

    async def check(self, authorization: str | None) -> Verdict:
        """The verdict for one request's Authorization header."""
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return Verdict(UNAUTHORIZED, "no bearer token")
        key = hashlib.sha256(token.encode()).hexdigest()
        now = self.clock()
        for cache in (self._allowed, self._cache):
            cached = cache.get(key)
            if cached is not None and cached[0] > now:
                cache.move_to_end(key)
                return cached[1]
        if not self._spend(now):
            return Verdict(TOO_MANY, "too many unknown tokens: review refused")
        verdict = await self._review(token)
        allowed = verdict.status == OK
        cache, size = (self._allowed, ALLOWED_SIZE) if allowed else (self._cache, CACHE_SIZE)
        cache[key] = (now + (ALLOWED_TTL if allowed else DENIED_TTL), verdict)
        cache.move_to_end(key)
        while len(cache) > size:
            cache.popitem(last=False)
        return verdict

    def _spend(self, now: float) -> bool:
        """Take one review from the budget (a token bucket); False when it is empty."""
        self._budget = min(float(REVIEW_BURST),
                           self._budget + (now - self._filled) * REVIEWS_PER_SECOND)  # fmt: skip
        self._filled = now
        if self._budget < 1:
            return False
        self._budget -= 1
        return True

    async def _review(self, token: str) -> Verdict:
        spec: dict[str, Any] = {"token": token}
        if self.audiences:
            spec["audiences"] = list(self.audiences)
        answer = await self.api.review(TOKEN_REVIEWS, {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": spec,
        })  # fmt: skip
        status = answer.get("status") or {}
        if not status.get("authenticated"):
            return Verdict(UNAUTHORIZED, str(status.get("error") or "token not authenticated"))
        if self.audiences and not set(self.audiences) & set(status.get("audiences") or []):
            # The API server checks them; an answer that names none of ours is not taken.
            return Verdict(UNAUTHORIZED, "token not issued for this audience")
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
