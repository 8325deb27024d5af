"""The operator's /metrics behind a bearer token: TokenReview, then SubjectAccessReview.

The API server is a test double here (the control-plane tier asks a real one); what is
checked is what the operator does with its answers.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, Counter
from vllm_dp_operator.observability.metrics_auth import (
    ACCESS_REVIEWS,
    CACHE_SIZE,
    DENIED_TTL,
    REVIEW_BURST,
    REVIEWS_PER_SECOND,
    TOKEN_REVIEWS,
    MetricsAuth,
)
from vllm_dp_operator.observability.metrics_http import serve_metrics


class ReviewsDouble:
    """Answers reviews as an API server would: tokens to users, users to permissions."""

    def __init__(self, users: dict[str, str], allowed: set[str],
                 audiences: dict[str, list[str]] | None = None) -> None:  # fmt: skip
        self.users, self.allowed = users, allowed
        #: Each token's audiences (unlisted: the API server's own, "api").
        self.audiences = audiences or {}
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.down = False

    async def review(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.down:
            raise ConnectionError("API server unreachable")
        self.calls.append((path, body))
        if path == TOKEN_REVIEWS:
            token = body["spec"]["token"]
            user = self.users.get(token)
            has = self.audiences.get(token, ["api"])
            asked = body["spec"].get("audiences") or ["api"]
            if user is None or not set(has) & set(asked):
                return {"status": {"authenticated": False, "error": "invalid bearer token"}}
            return {"status": {"authenticated": True, "audiences": sorted(set(has) & set(asked)),
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
    auth, _, clock = _auth()
    for i in range(CACHE_SIZE + 50):
        clock.now += 1 / REVIEWS_PER_SECOND  # within the review budget
        await auth.check(f"Bearer junk-{i}")
    assert len(auth._cache) == CACHE_SIZE


async def test_junk_tokens_neither_flood_the_api_server_nor_evict_a_scraper() -> None:
    """Issue 39: anyone who reaches the port may send tokens. Reviews of unknown tokens are
    limited (429 past the budget, with no review), and a scraper's allowed answer is kept
    apart from refusals, so a flood of junk does not make its next scrape a review."""
    auth, api, clock = _auth()
    assert (await auth.check("Bearer good")).status == 200
    asked = len(api.calls)
    got = [(await auth.check(f"Bearer junk-{i}")).status for i in range(REVIEW_BURST + 30)]
    assert got[:REVIEW_BURST - 1] == [401] * (REVIEW_BURST - 1) and set(got[REVIEW_BURST:]) == {429}
    assert len(api.calls) - asked == REVIEW_BURST - 1  # one review each, then none
    assert (await auth.check("Bearer good")).status == 200  # still cached: no review
    clock.now += 1.0  # the budget fills again
    assert (await auth.check("Bearer junk-new")).status == 401
    for i in range(CACHE_SIZE + 10):  # more refusals than the cache holds, within a minute
        clock.now += 1 / REVIEWS_PER_SECOND
        await auth.check(f"Bearer more-{i}")
    asked = len(api.calls)
    assert (await auth.check("Bearer good")).status == 200 and len(api.calls) == asked


async def test_an_audience_is_asked_for_and_a_token_for_another_refused() -> None:
    api = ReviewsDouble({"prom": "system:serviceaccount:mon:prometheus",
                         "default": "system:serviceaccount:mon:prometheus"},
                        {"system:serviceaccount:mon:prometheus"},
                        {"prom": ["vllm-dp-operator-metrics"]})  # fmt: skip
    auth = MetricsAuth(api, clock=Clock(), audiences=("vllm-dp-operator-metrics",))
    assert (await auth.check("Bearer prom")).status == 200
    assert api.calls[0][1]["spec"]["audiences"] == ["vllm-dp-operator-metrics"]
    # The default token (the API server's audience) is not one the metrics asked for.
    assert (await auth.check("Bearer default")).status == 401
    # Without the setting, the API server's own audiences, as before.
    plain = MetricsAuth(api, clock=Clock())
    assert (await plain.check("Bearer default")).status == 200
    assert "audiences" not in api.calls[-2][1]["spec"]


async def test_an_answer_that_names_none_of_our_audiences_is_not_taken() -> None:
    class Careless(ReviewsDouble):
        async def review(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
            answer = await super().review(path, body)
            (answer.get("status") or {}).pop("audiences", None)
            return answer

    api = Careless({"t": "system:serviceaccount:mon:prometheus"},
                   {"system:serviceaccount:mon:prometheus"}, {"t": ["m"]})  # fmt: skip
    auth = MetricsAuth(api, clock=Clock(), audiences=("m",))
    assert (await auth.check("Bearer t")).status == 401


async def _scrape(port: int, token: str | None, path: str = "/metrics") -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as http, \
            http.get(f"http://127.0.0.1:{port}{path}", headers=headers) as resp:
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


async def test_the_controller_counters_need_the_same_authorization() -> None:
    """The counters say how many objects each watched namespace holds: not for anyone who
    reaches the pod (the liveness probe says only "alive"), but for an authorized scraper."""
    auth, _, _ = _auth()
    counters = {"cached": {"vllmdataparallels": 7}, "ready": True}
    runner = await serve_metrics(CollectorRegistry(), "127.0.0.1", 0, auth,
                                 counters=lambda: counters)  # fmt: skip
    try:
        port = runner.addresses[0][1]
        for token, status in ((None, 401), ("other", 403)):
            code, text = await _scrape(port, token, "/debug/controller")
            assert code == status and "vllmdataparallels" not in text, (token, code, text)
        code, text = await _scrape(port, "good", "/debug/controller")
        assert code == 200 and json.loads(text) == counters
    finally:
        await runner.cleanup()
