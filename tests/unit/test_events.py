"""Events go out in the background, a few at a time, and never fail a reconcile."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException
from vllm_dp_operator.controller.events import EVENT, EventPoster, event_body
from vllm_dp_operator.controller.kube import Kind, NamespaceTerminating

TARGET = {"apiVersion": "vllmdp.io/v1alpha1", "kind": "VLLMDataParallel",
          "metadata": {"name": "demo", "namespace": "ns", "uid": "u1"}}  # fmt: skip


class Recorder:
    """Test double for the Kube seam's create: records bodies, may fail, counts concurrency."""

    def __init__(self, fail: int = 0, error: Exception | None = None) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.fail = fail
        self.error = error or ApiException(status=500, reason="boom")
        self.running = 0
        self.most = 0

    async def create(self, kind: Kind, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        assert kind == EVENT and namespace == body["metadata"]["namespace"]
        self.running += 1
        self.most = max(self.most, self.running)
        await asyncio.sleep(0.005)
        self.running -= 1
        if self.fail:
            self.fail -= 1
            raise self.error
        self.bodies.append(body)
        return body


async def post_and_settle(api: Recorder, workers: int, count: int, expect: int) -> list[Any]:
    """Start a poster over `api`, post `count` Events, wait (2 s at most) until `expect` went
    out, and hand back its worker tasks (the caller checks and cancels them)."""
    poster = EventPoster(api, workers=workers)  # type: ignore[arg-type]
    tasks = poster.start()
    for i in range(count):
        poster.post(TARGET, "Normal", "R", f"m{i}")
    for _ in range(200):
        if len(api.bodies) == expect:
            break
        await asyncio.sleep(0.01)
    return tasks


def test_event_body_names_the_object_and_caps_the_message() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    body = event_body(TARGET, "Warning", "HeadJobFailed", "x" * 5000, now)
    assert body["involvedObject"] == {"apiVersion": "vllmdp.io/v1alpha1",
                                      "kind": "VLLMDataParallel", "name": "demo",
                                      "namespace": "ns", "uid": "u1"}  # fmt: skip
    assert body["metadata"] == {"generateName": "demo.", "namespace": "ns"}
    assert body["type"] == "Warning" and body["reason"] == "HeadJobFailed"
    assert len(body["message"]) <= 1024 and "..." in body["message"]
    assert body["firstTimestamp"].startswith("2026-01-01T00:00:00")


async def test_poster_posts_in_order_with_bounded_concurrency_and_survives_errors() -> None:
    api = Recorder(fail=1)
    tasks = await post_and_settle(api, workers=2, count=20, expect=19)
    try:
        assert len(api.bodies) == 19, "one failed post is logged and dropped, the rest go out"
        assert api.most == 2
    finally:
        for task in tasks:
            task.cancel()


async def test_a_full_backlog_drops_instead_of_blocking() -> None:
    poster = EventPoster(Recorder(), workers=1, backlog=3)  # type: ignore[arg-type]
    for i in range(5):
        poster.post(TARGET, "Normal", "R", f"m{i}")
    assert poster.dropped == 2


async def test_no_error_stops_a_poster() -> None:
    """An Event for a resource in a terminating namespace (or any surprise) costs that Event
    only: the workers go on, or every later Event of every resource would be lost."""
    for error in (NamespaceTerminating("ns"), RuntimeError("surprise")):
        api = Recorder(fail=2, error=error)
        tasks = await post_and_settle(api, workers=1, count=5, expect=3)
        try:
            assert [b["message"] for b in api.bodies] == ["m2", "m3", "m4"], error
            assert not any(t.done() for t in tasks)
        finally:
            for task in tasks:
                task.cancel()
