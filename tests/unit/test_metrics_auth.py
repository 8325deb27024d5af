"""The operator's /metrics behind a bearer token: TokenReview, then SubjectAccessReview.

The API server is a test double here (the control-plane tier asks a real one); what is
checked is what the operator does with its answers.
"""

from __future__ import annotations

from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, Counter
from vllm_dp_operator.observability.metrics_auth import (
    ACCESS_REVIEWS,
    CACHE_SIZE,
    DENIED_TTL,
    TOKEN_REVIEWS,
    MetricsAuth,
)
from vllm_dp_operator.observability.metrics_http import serve_metrics


class ReviewsDouble:
    """Answers reviews as an API server would: tokens to users, users to permissions."""

    def __init__(self, users: dict[str, str], allowed: set[str]) -> None:
        self.users, self.allowed = users, allowed
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.down = False

    async def review(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.down:
            raise ConnectionError("API server unreachable")
        self.calls.append((path, body))
        if path == TOKEN_REVIEWS:
            user = self.users.get(body["spec"]["token"])
            if user is None:
                return {"status": {"authenticated": False, "error": "invalid bearer token"}}
            return {"status": {"authenticated": True,
                               "user": {"username": user, "groups": ["g"], "uid": "u1"}}}
        assert path == ACCESS_REVIEWS
        spec = body["spec"]
        assert spec["nonResourceAttributes"] == {"path": "/metrics", "verb": "get"}
        assert spec["groups"] == ["g"] and spec["uid"] == "u1"
        return {"status": {"allowed": spec["user"] in self.allowed}}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _auth() -> tuple[MetricsAuth, ReviewsDouble, Clock]:
    api = ReviewsDouble({"good": "system:serviceaccount:mon:prometheus",
                         "other": "system:serviceaccount:x:nobody"},
                        {"system:serviceaccount:mon:prometheus"})  # fmt: skip
    clock = Clock()
    return MetricsAuth(api, clock=clock), api, clock


async def test_no_bearer_token_is_401_without_asking_the_api_server() -> None:
    auth, api, _ = _auth()
    for header in (None, "", "Basic abc", "Bearer ", "bearer"):
        assert (await auth.check(header)).status == 401
    assert api.calls == []


async def test_an_unknown_token_is_401_a_user_without_the_rbac_403_a_reader_200() -> None:
    auth, api, _ = _auth()
    assert (await auth.check("Bearer junk")).status == 401
    assert [p for p, _ in api.calls] == [TOKEN_REVIEWS]  # no access review for nobody
    assert (await auth.check("Bearer other")).status == 403
    verdict = await auth.check("Bearer good")
    assert verdict.status == 200 and verdict.reason == "system:serviceaccount:mon:prometheus"


async def test_answers_are_reused_for_a_while_then_asked_again() -> None:
    auth, api, clock = _auth()
    await auth.check("Bearer good")
    asked = len(api.calls)
    for _ in range(5):
        assert (await auth.check("Bearer good")).status == 200
    assert len(api.calls) == asked  # a scrape every few seconds costs no review
    await auth.check("Bearer other")
    clock.now += DENIED_TTL + 1
    api.allowed.add("system:serviceaccount:x:nobody")  # RBAC granted meanwhile
    assert (await auth.check("Bearer other")).status == 200  # a refusal is not kept long


async def test_the_cache_is_bounded() -> None:
    auth, _, _ = _auth()
    for i in range(CACHE_SIZE + 50):
        await auth.check(f"Bearer junk-{i}")
    assert len(auth._cache) == CACHE_SIZE


async def _scrape(port: int, token: str | None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as http, \
            http.get(f"http://127.0.0.1:{port}/metrics", headers=headers) as resp:
        return resp.status, await resp.text()


async def test_the_endpoint_serves_only_an_authorized_scrape() -> None:
    registry = CollectorRegistry()
    Counter("vllmdp_demo", "demo", registry=registry).inc()
    auth, api, _ = _auth()
    runner = await serve_metrics(registry, "127.0.0.1", 0, auth)
    try:
        port = runner.addresses[0][1]
        status, text = await _scrape(port, None)
        assert status == 401 and "vllmdp_demo" not in text
        status, text = await _scrape(port, "other")
        assert status == 403 and "vllmdp_demo" not in text
        status, text = await _scrape(port, "good")
        assert status == 200 and "vllmdp_demo_total 1.0" in text
        api.down = True
        status, _ = await _scrape(port, "fresh-token")
        assert status == 503  # no verdict without the API server, and none cached
        api.down = False
        api.users["fresh-token"] = "system:serviceaccount:mon:prometheus"
        assert (await _scrape(port, "fresh-token"))[0] == 200
    finally:
        await runner.cleanup()
