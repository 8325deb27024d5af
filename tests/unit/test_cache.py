"""The object cache, the cache-backed Kube and the reflector, against the FakeApi double."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from fake_api import FakeApi
from vllm_dp_operator import constants as c
from vllm_dp_operator.controller import cache as cache_module
from vllm_dp_operator.controller import informer as informer_module
from vllm_dp_operator.controller.cache import (
    MANAGED_SELECTOR,
    CachedKube,
    ObjectCache,
    owner_key,
    parse_selector,
    slim,
)
from vllm_dp_operator.controller.informer import RETRY_CAP_SECONDS, Reflector
from vllm_dp_operator.controller.kube import ENDPOINTSLICE, POD, RAYCLUSTER, RAYJOB, SERVICE, Kind


def obj(name: str, instance: str = "demo", rv: str = "1", uid: str | None = None,
        **extra: Any) -> dict[str, Any]:  # fmt: skip
    labels = {c.LABEL_INSTANCE: instance, c.LABEL_MANAGED_BY: c.MANAGER, **extra.pop("labels", {})}
    meta = {"name": name, "namespace": "default", "uid": uid or f"uid-{name}",
            "resourceVersion": rv, "labels": labels}  # fmt: skip
    return {"metadata": meta, **extra}


def test_slim_drops_managed_fields_and_pod_templates() -> None:
    raw = obj("rc", spec={"suspend": True, "headGroupSpec": {"template": {"spec": "big"}},
                          "workerGroupSpecs": [{"groupName": "gpu", "replicas": 2,
                                                "template": {"spec": "big"}}]},
              status={"state": "ready"})  # fmt: skip
    raw["metadata"]["managedFields"] = [{"manager": "kubectl"}]
    out = slim(RAYCLUSTER, raw)
    assert "managedFields" not in out["metadata"]
    assert out["spec"] == {"suspend": True,
                           "workerGroupSpecs": [{"groupName": "gpu", "replicas": 2}]}
    assert out["status"] == {"state": "ready"}
    job = slim(RAYJOB, obj("j", spec={"entrypoint": "x", "submitterPodTemplate": {}}))
    assert job["spec"] == {"entrypoint": "x"}
    pod = slim(POD, obj("p", spec={"nodeName": "n1", "containers": [{}]},
                        status={"phase": "Pending"}))
    assert pod["spec"] == {"nodeName": "n1"} and pod["status"] == {"phase": "Pending"}


def test_slim_interns_repeated_strings_and_shares_nothing_with_the_body() -> None:
    # Two bodies parsed apart (as two watch events are) hold their own copies of every key and
    # label value; the cache keeps one of each, so 10,000 resources do not hold them 10,000
    # times over. What a reader sees is unchanged.
    import json

    def parsed(name: str) -> dict[str, Any]:
        body = obj(name, spec={"type": "ClusterIP", "ports": [{"name": "http", "port": 8000}]},
                   status={"conditions": [{"type": "Ready", "status": "True",
                                           "message": "m" * (cache_module.INTERN_MAX + 1)}]})
        loaded: dict[str, Any] = json.loads(json.dumps(body))
        return loaded

    a_raw, b_raw = parsed("a"), parsed("b")
    assert a_raw["spec"]["type"] is not b_raw["spec"]["type"]  # what a JSON parse gives
    a, b = slim(SERVICE, a_raw), slim(SERVICE, b_raw)
    assert a == {"metadata": a_raw["metadata"], "spec": a_raw["spec"], "status": a_raw["status"]}
    assert a["spec"]["type"] is b["spec"]["type"]
    label = c.LABEL_MANAGED_BY
    assert a["metadata"]["labels"][label] is b["metadata"]["labels"][label]
    key_a = next(k for k in a["status"]["conditions"][0] if k == "status")
    key_b = next(k for k in b["status"]["conditions"][0] if k == "status")
    assert key_a is key_b
    # A long free text is not interned (it rarely repeats across objects), but held once per
    # object: a status repeats its message in several conditions.
    assert a["status"]["conditions"][0]["message"] is not b["status"]["conditions"][0]["message"]
    twice = json.loads(json.dumps({"status": {"message": "m" * 99, "conditions": [
        {"message": "m" * 99}]}}))
    kept = slim(SERVICE, {"metadata": {"name": "x"}, **twice})["status"]
    assert kept["message"] is kept["conditions"][0]["message"]
    # A copy: changing the body afterwards (kopf reuses its event dicts) leaves the cache alone.
    a_raw["spec"]["ports"][0]["port"] = 1
    a_raw["status"]["conditions"].clear()
    assert a["spec"]["ports"][0]["port"] == 8000 and a["status"]["conditions"]


def test_parse_selector_takes_equality_terms_only() -> None:
    assert parse_selector("a=1,b=2") == {"a": "1", "b": "2"}
    assert parse_selector("") == {}
    for unsupported in ("a!=1", "a", "a in (1,2)", "a==1"):
        assert parse_selector(unsupported) is None, unsupported


def test_select_reads_the_label_index_and_filters_every_term() -> None:
    cache = ObjectCache([POD])
    cache.upsert(POD, obj("p1", labels={c.LABEL_RAY_CLUSTER: "demo-abcde"}))
    cache.upsert(POD, obj("p2", labels={c.LABEL_RAY_CLUSTER: "demo-fghij"}))
    cache.upsert(POD, obj("q1", instance="other", labels={c.LABEL_RAY_CLUSTER: "other-1"}))
    names = [p["metadata"]["name"]
             for p in cache.select(POD, "default", {c.LABEL_RAY_CLUSTER: "demo-abcde"})]
    assert names == ["p1"]
    both = cache.select(POD, "default", {c.LABEL_INSTANCE: "demo"})
    assert [p["metadata"]["name"] for p in both] == ["p1", "p2"]
    assert cache.select(POD, "elsewhere", {c.LABEL_INSTANCE: "demo"}) == []
    copy_ = cache.get(POD, "default", "p1")
    assert copy_ is not None
    copy_["metadata"]["labels"].clear()  # the reconcile may change what it reads
    assert cache.select(POD, "default", {c.LABEL_RAY_CLUSTER: "demo-abcde"})


def test_a_reconciles_selectors_read_an_index_not_every_cached_object() -> None:
    # At 10,000 resources a scan of a kind is 10,000 objects per reconcile: every selector the
    # reconcile makes (instance, Ray cluster, and routing's Service name) reads one bucket.
    class NoScan(dict[Any, Any]):
        def items(self) -> Any:
            raise AssertionError("scanned every cached object")

    cache = ObjectCache([ENDPOINTSLICE])
    for name, service in (("a-api", "a-api"), ("b-api", "b-api"), ("a-mirror", "a-api")):
        cache.upsert(ENDPOINTSLICE, obj(name, labels={c.LABEL_SERVICE_NAME: service}))
    cache._objects[ENDPOINTSLICE] = NoScan(cache._objects[ENDPOINTSLICE])
    found = cache.select(ENDPOINTSLICE, "default", {c.LABEL_SERVICE_NAME: "a-api"})
    assert [s["metadata"]["name"] for s in found] == ["a-api", "a-mirror"]
    assert cache.select(ENDPOINTSLICE, "default", {c.LABEL_INSTANCE: "demo"})


def test_a_watch_event_before_our_write_never_overwrites_its_answer() -> None:
    # resourceVersions are opaque: what orders them is the watch, which delivers an object's
    # versions in order. Until it echoes our write's version, what it brings is older.
    cache = ObjectCache([RAYJOB])
    cache.wrote(RAYJOB, obj("j", rv="b7", status={"jobStatus": "RUNNING"}))
    assert not cache.upsert(RAYJOB, obj("j", rv="a9", status={"jobStatus": "PENDING"}))
    got = cache.get(RAYJOB, "default", "j")
    assert got is not None and got["status"]["jobStatus"] == "RUNNING"
    assert not cache.upsert(RAYJOB, obj("j", rv="b7", status={"jobStatus": "RUNNING"})), "echo"
    # After the echo, the watch's next version is news, whatever its spelling.
    assert cache.upsert(RAYJOB, obj("j", rv="a1", status={"jobStatus": "FAILED"}))
    assert not cache.upsert(RAYJOB, obj("j", rv="a1", status={"jobStatus": "FAILED"}))
    # A write's answer that comes after the watch already brought that version is no news.
    cache.wrote(RAYJOB, obj("j", rv="a1", status={"jobStatus": "FAILED"}))
    assert cache.upsert(RAYJOB, obj("j", rv="c2", status={"jobStatus": "SUCCEEDED"}))
    # A new object of the same name (another uid) replaces it whatever its version.
    assert cache.upsert(RAYJOB, obj("j", rv="3", uid="again"))
    # A delete of the old uid does not remove the new object.
    assert cache.remove(RAYJOB, obj("j", uid="uid-j")) is None
    assert cache.remove(RAYJOB, obj("j", uid="again")) is not None
    assert cache.count(RAYJOB) == 0


def test_a_newer_generation_lands_over_a_held_write() -> None:
    # kopf hands on only the last of a quick run of events: the echo of our status patch may
    # never come, and a user's edit after it must land all the same.
    cache = ObjectCache([RAYJOB])
    cache.wrote(RAYJOB, {**obj("j", rv="5"), "spec": {"x": 1}})
    cache._objects[RAYJOB][("default", "j")]["metadata"]["generation"] = 1
    newer = {**obj("j", rv="9"), "spec": {"x": 2}}
    newer["metadata"]["generation"] = 2
    assert cache.upsert(RAYJOB, newer)
    got = cache.get(RAYJOB, "default", "j")
    assert got is not None and got["spec"] == {"x": 2}


def test_an_answer_whose_version_the_watch_brought_while_an_older_answer_waited_lands() -> None:
    # Two status patches in a row; kopf hands on only the second's event (it skips the first's
    # echo), and that event comes before the second patch's answer. The event is set aside
    # as older than the first answer; the second answer then names that very version, which
    # the cache must hold from then on: a patch that changes nothing brings no new version.
    cache = ObjectCache([RAYJOB])
    cache.upsert(RAYJOB, obj("j", rv="1", status={}))
    cache.wrote(RAYJOB, obj("j", rv="2", status={"phase": "Provisioning"}))
    assert not cache.upsert(RAYJOB, obj("j", rv="3", status={"phase": "Launching"}))
    cache.wrote(RAYJOB, obj("j", rv="3", status={"phase": "Launching"}))
    got = cache.get(RAYJOB, "default", "j")
    assert got is not None and got["status"] == {"phase": "Launching"}
    assert got["metadata"]["resourceVersion"] == "3"
    # Held no longer: the next version is news.
    assert cache.upsert(RAYJOB, obj("j", rv="4", status={"phase": "Serving"}))


def test_an_answer_the_watch_has_moved_past_takes_the_newest_event_set_aside() -> None:
    cache = ObjectCache([RAYJOB])
    cache.wrote(RAYJOB, obj("j", rv="2", status={"phase": "Provisioning"}))
    assert not cache.upsert(RAYJOB, obj("j", rv="3", status={"phase": "Launching"}))
    assert not cache.upsert(RAYJOB, obj("j", rv="4", status={"phase": "Launching"},
                                        labels={"edited": "yes"}))  # fmt: skip
    cache.wrote(RAYJOB, obj("j", rv="3", status={"phase": "Launching"}))
    got = cache.get(RAYJOB, "default", "j")
    assert got is not None and got["metadata"]["resourceVersion"] == "4"
    assert got["metadata"]["labels"]["edited"] == "yes"


def test_replace_reports_added_changed_and_vanished_objects() -> None:
    cache = ObjectCache([SERVICE])
    cache.upsert(SERVICE, obj("keep", rv="1"))
    cache.upsert(SERVICE, obj("change", rv="1"))
    cache.upsert(SERVICE, obj("gone", instance="lost", rv="1"))
    touched = cache.replace(SERVICE, [obj("keep", rv="1"), obj("change", rv="5"),
                                      obj("new", rv="6")], namespace=None)  # fmt: skip
    assert sorted(o["metadata"]["name"] for o in touched) == ["change", "gone", "new"]
    assert owner_key(next(o for o in touched if o["metadata"]["name"] == "gone")) == (
        "default", "lost")
    assert cache.get(SERVICE, "default", "gone") is None
    assert cache.select(SERVICE, "default", {c.LABEL_INSTANCE: "lost"}) == []


def test_replace_keeps_what_we_wrote_after_the_list_began() -> None:
    cache = ObjectCache([RAYJOB])
    cache.wrote(RAYJOB, obj("before", rv="x1"))  # answered before the LIST was sent
    since = cache.writes
    cache.wrote(RAYJOB, obj("during", rv="x9"))  # answered while the LIST was on its way
    touched = cache.replace(RAYJOB, [obj("other", instance="b", rv="x5")], None, since)
    # The LIST cannot hold what was written after it began: that stays, for the watch to
    # echo. A write answered before it began is in the LIST if it still exists: it went.
    assert cache.get(RAYJOB, "default", "during") is not None
    assert cache.get(RAYJOB, "default", "before") is None
    assert sorted(o["metadata"]["name"] for o in touched) == ["before", "other"]
    assert not cache.upsert(RAYJOB, obj("during", rv="x9")), "the watch's echo is no news"


async def test_cached_kube_reads_from_cache_and_writes_through() -> None:
    api = FakeApi()
    cache = ObjectCache([SERVICE])
    kube = CachedKube(api, cache)
    await kube.create(SERVICE, "default", obj("svc"))
    # The create's answer is in the cache before any watch event arrives.
    assert await kube.get(SERVICE, "default", "svc") is not None
    assert await kube.list(SERVICE, "default", f"{c.LABEL_INSTANCE}=demo")
    await kube.delete(SERVICE, "default", "svc")
    marked = cache.get(SERVICE, "default", "svc")
    assert marked is not None and marked["metadata"]["deletionTimestamp"]
    assert api.calls["get"] == 0 and api.calls["list"] == 0 and kube.api_reads == 0
    # An uncached kind, or a selector the cache cannot answer, goes to the API.
    await kube.list(POD, "default", "a!=b")
    assert kube.api_reads == 1 and api.calls["list"] == 1


async def _until(what: str, check: Any, timeout: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


async def _reflect(api: FakeApi, kind: Kind) -> tuple[Reflector, list[str], asyncio.Task[None]]:
    seen: list[str] = []
    reflector = Reflector(api, ObjectCache([kind]), kind, None, MANAGED_SELECTOR,
                          lambda o: seen.append(o["metadata"]["name"]), page_size=2)
    task = asyncio.create_task(reflector.run())
    await asyncio.wait_for(reflector.synced.wait(), timeout=2)
    return reflector, seen, task


async def test_reflector_lists_in_pages_then_follows_the_watch() -> None:
    api = FakeApi()
    for i in range(5):
        api.put(RAYCLUSTER, obj(f"rc{i}"))
    api.put(RAYCLUSTER, {"metadata": {"name": "unmanaged", "labels": {}}})
    reflector, seen, task = await _reflect(api, RAYCLUSTER)
    try:
        assert api.calls["list_page"] == 3  # 5 objects, 2 a page
        assert reflector.cache.count(RAYCLUSTER) == 5, "the label selector filters"
        seen.clear()
        api.set_status(RAYCLUSTER, "default", "rc1", {"state": "ready"})
        await _until("the status event", lambda: seen == ["rc1"])
        cached = reflector.cache.get(RAYCLUSTER, "default", "rc1")
        assert cached is not None and cached["status"] == {"state": "ready"}
        await api.delete(RAYCLUSTER, "default", "rc2")
        await _until("the delete event", lambda: seen == ["rc1", "rc2"])
        assert reflector.cache.get(RAYCLUSTER, "default", "rc2") is None
        # The server ends the watch: the reflector resumes from its resourceVersion, no relist.
        api.end_watches()
        api.set_status(RAYCLUSTER, "default", "rc3", {"state": "ready"})
        await _until("the event after a renewed watch", lambda: seen[-1:] == ["rc3"])
        assert api.calls["list_page"] == 3 and reflector.lists == 1
    finally:
        task.cancel()


class _PageLog(FakeApi):
    """Logs each page request, beside the reflector's slim calls (see the test)."""

    def __init__(self, sequence: list[str]) -> None:
        super().__init__()
        self.sequence = sequence

    async def list_page(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.sequence.append("page")
        return await super().list_page(*args, **kwargs)


async def test_a_relist_slims_each_page_before_it_asks_for_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A relist of 10,000 objects must not hold them all as the API sent them: each page is
    slimmed (managedFields and pod templates dropped) before the next one is requested."""
    log: list[str] = []

    def logged_slim(kind: Kind, raw: dict[str, Any]) -> dict[str, Any]:
        log.append("slim")
        return cache_module.slim(kind, raw)

    monkeypatch.setattr(informer_module, "slim", logged_slim, raising=False)
    api = _PageLog(log)
    for i in range(5):
        api.put(RAYCLUSTER, obj(f"rc{i}"))
    _reflector, _seen, task = await _reflect(api, RAYCLUSTER)
    try:
        assert log == ["page", "slim", "slim", "page", "slim", "slim", "page", "slim"]
    finally:
        task.cancel()


async def test_reflector_relists_after_410_and_reports_what_vanished() -> None:
    api = FakeApi()
    api.put(RAYJOB, obj("j1", instance="a"))
    api.put(RAYJOB, obj("j2", instance="b"))
    reflector, seen, task = await _reflect(api, RAYJOB)
    try:
        # While no watch runs, j1 is deleted and the server compacts its history.
        api.end_watches()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await api.delete(RAYJOB, "default", "j1")
        api.put(RAYJOB, obj("j3", instance="c"))
        api.compact()
        seen.clear()
        task = asyncio.create_task(reflector.run())  # resumes from its old version
        await _until("a relist", lambda: reflector.lists == 2)
        assert sorted(seen) == ["j1", "j3"], "the deletion missed in the gap is reported"
        assert reflector.cache.get(RAYJOB, "default", "j1") is None
    finally:
        task.cancel()


class _Down(FakeApi):
    """The API server unreachable for the first `failures` LISTs."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def list_page(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if self.failures > 0:
            self.failures -= 1
            raise aiohttp.ClientConnectionError("connection refused")
        return await super().list_page(*args, **kwargs)


async def test_reflector_retries_an_outage_at_most_retry_cap_apart(monkeypatch: Any) -> None:
    # Found by the reliability tier: with a 30 s cap the watches came back 16 s after the API
    # server did. Each wait doubles from 0.5 s, up to the cap.
    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr("vllm_dp_operator.controller.informer.asyncio.sleep", sleep)
    api = _Down(failures=8)
    reflector = Reflector(api, ObjectCache([POD]), POD, None, MANAGED_SELECTOR, lambda o: None)
    task = asyncio.create_task(reflector.run())
    try:
        await asyncio.wait_for(reflector.synced.wait(), timeout=2)
    finally:
        task.cancel()
    assert waits == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0]
    assert max(waits) == RETRY_CAP_SECONDS


class _Breaks(FakeApi):
    """The first watch stream breaks after two events and a bookmark, as a reset does."""

    def __init__(self) -> None:
        super().__init__()
        self.watched_from: list[str] = []

    async def watch(self, kind: Kind, namespace: str | None, selector: str,
                    resource_version: str, timeout_seconds: int,
                    fields: str = "") -> Any:  # fmt: skip
        self.watched_from.append(resource_version)
        seen = 0
        async for event in super().watch(kind, namespace, selector, resource_version,
                                         timeout_seconds, fields):  # fmt: skip
            yield event
            seen += 1
            if len(self.watched_from) == 1 and seen == 2:
                at = {"resourceVersion": str(self.rv)}
                yield {"type": "BOOKMARK", "object": {"metadata": at}}
                raise aiohttp.ClientPayloadError("connection reset mid-stream")


async def test_a_watch_broken_mid_stream_resumes_from_its_last_event() -> None:
    api = _Breaks()
    api.put(POD, obj("p0"))
    reflector, seen, task = await _reflect(api, POD)
    try:
        listed_at = reflector.resource_version
        seen.clear()
        api.put(POD, obj("p1"))
        api.put(POD, obj("p2"))
        api.put(RAYCLUSTER, obj("rc"))  # another kind: only the bookmark carries its version
        last = api.rv
        await _until("a second watch", lambda: len(api.watched_from) == 2)
        assert api.watched_from == [listed_at, str(last)], "resumes at the bookmark after p2"
        api.put(POD, obj("p3"))
        await _until("the event after the break", lambda: seen[-1:] == ["p3"])
        assert seen == ["p1", "p2", "p3"], "nothing replayed, nothing missed"
    finally:
        task.cancel()
