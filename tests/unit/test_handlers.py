"""The kopf handlers: owner events go to the controller, kopf writes nothing; a namespace being
deleted is told apart from a real 403 (the controller then drops the resource quietly,
tests/unit/test_controller.py)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import kopf
from kubernetes_asyncio.client.exceptions import ApiException
from vllm_dp_operator import handlers
from vllm_dp_operator.controller.kube import _namespace_terminating


class _Answer:
    """The parts of an HTTP response ApiException reads."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        self.status, self.reason, self.data = status, "Forbidden", json.dumps(body).encode()

    def getheaders(self) -> dict[str, str]:
        return {}


def _forbidden(causes: list[dict[str, str]]) -> ApiException:
    body = {"kind": "Status", "apiVersion": "v1", "code": 403, "reason": "Forbidden",
            "message": "forbidden", "details": {"causes": causes}}  # fmt: skip
    exc = ApiException(http_resp=_Answer(403, body))
    exc.body = exc.body.decode()
    return exc


def test_terminating_namespace_is_told_apart_from_rbac() -> None:
    terminating = _forbidden([{"reason": "NamespaceTerminating", "message": "is being terminated",
                               "field": "metadata.namespace"}])  # fmt: skip
    assert _namespace_terminating(terminating)
    assert not _namespace_terminating(_forbidden([]))  # RBAC: a real failure, raised


class _Controller:
    """Test double for the controller: records the owner events handed to it."""

    def __init__(self) -> None:
        self.seen: list[tuple[str | None, str]] = []
        self.leading = asyncio.Event()  # a standby: it releases no legacy finalizer

    def owner_event(self, event_type: str | None, body: dict[str, Any]) -> None:
        self.seen.append((event_type, body["metadata"]["name"]))


async def test_owner_events_go_to_the_controller_and_kopf_writes_nothing() -> None:
    memo = kopf.Memo()
    memo.controller = _Controller()
    event: Any = {"type": None, "object": {"metadata": {"name": "demo", "namespace": "ns"}}}
    # None: kopf patches nothing into status for an on.event handler that returns None.
    assert await handlers.on_owner_event(event=event, memo=memo) is None
    assert memo.controller.seen == [(None, "demo")]
    # No changing handlers: the diff base is empty, not a deep copy of every body.
    body = kopf.Body({"metadata": {"name": "demo"}, "spec": {"model": "m"}})
    assert handlers._NoDiffBase(prefix="vllmdp.io").build(body=body) == {}


def test_the_per_event_success_line_is_dropped_and_nothing_else() -> None:
    chatter = handlers._NoEventHandlerChatter()

    def record(level: int, message: str) -> logging.LogRecord:
        return logging.LogRecord("kopf.objects", level, __file__, 1, message, None, None)

    assert not chatter.filter(record(logging.INFO, "Handler 'on_owner_event' succeeded."))
    assert chatter.filter(record(logging.ERROR, "Handler 'on_owner_event' failed."))
    assert chatter.filter(record(logging.INFO, "Removing the finalizer"))


async def test_kopf_lists_the_resource_kind_in_pages(monkeypatch: Any) -> None:
    # kopf's own LIST of the owners (at start, after a 410) is paginated as configured, so at
    # 10,000 resources it never parses every body at once. kopf's default is one LIST.
    from kopf._cogs.clients import api, fetching
    from kopf._cogs.structs import references

    settings = kopf.OperatorSettings()
    assert settings.watching.chunk_size is None  # kopf's default: one unpaginated LIST
    handlers.configure(settings)
    urls: list[str] = []
    pages = {"": ("p2", ["a", "b"]), "p2": ("", ["c"])}

    async def get(url: str, **_: Any) -> dict[str, Any]:
        urls.append(url)
        token = url.partition("continue=")[2]
        nxt, names = pages[token]
        return {"items": [{"metadata": {"name": n}} for n in names],
                "metadata": {"continue": nxt, "resourceVersion": "7"}}  # fmt: skip

    monkeypatch.setattr(api, "get", get)
    resource = references.Resource("vllmdp.io", "v1alpha1", "vllmdataparallels",
                                   namespaced=True)  # fmt: skip
    names = [item["metadata"]["name"]
             async for items, _ in fetching.fetch_objs(settings=settings, resource=resource,
                                                       namespace=None, logger=logging.getLogger())
             for item in items]  # fmt: skip
    assert names == ["a", "b", "c"]
    assert len(urls) == 2 and all(f"limit={handlers.OWNER_LIST_PAGE}" in u for u in urls), urls
    # Writes nothing of its own, as before: no Events, no diff base.
    assert settings.posting.enabled is False
    assert isinstance(settings.persistence.diffbase_storage, handlers._NoDiffBase)


async def test_kopf_object_workers_let_go_of_a_body_soon_after_its_event() -> None:
    # kopf's worker for one object waits for its next event holding the last body as the API
    # sent it: with kopf's 5 s, a start with 10,000 resources held thousands at once.
    from kopf._core.reactor import queueing

    settings = kopf.OperatorSettings()
    handlers.configure(settings)
    key: Any = ("vllmdataparallels", "uid-1")
    streams: Any = {key: queueing.Stream(backlog=asyncio.Queue(), pressure=asyncio.Event())}
    seen: list[Any] = []

    async def processor(*, raw_event: Any, **_: Any) -> None:
        seen.append(raw_event["object"]["metadata"]["name"])

    streams[key].backlog.put_nowait({"type": None, "object": {"metadata": {"name": "demo"}}})
    loop = asyncio.get_running_loop()
    start = loop.time()
    # kopf's default (5 s) would outlive this wait.
    await asyncio.wait_for(queueing.worker(signaller=asyncio.Condition(), settings=settings,
                                           processor=processor, streams=streams, key=key),
                           timeout=3)  # fmt: skip
    assert seen == ["demo"] and key not in streams
    assert loop.time() - start < 3
