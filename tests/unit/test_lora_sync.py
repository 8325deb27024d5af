"""LoRA adapters brought to the spec on one head (engines/lora.py), through the probe pool
(engines/prober.py), and summed up across replicas (reconcile/lora_status.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

from test_prober import EngineDouble
from vllm_dp_operator.api.validation import validate
from vllm_dp_operator.engines.lora import Adapter, LoraState, sync
from vllm_dp_operator.engines.prober import ProbePool, Target
from vllm_dp_operator.engines.transport import Answer
from vllm_dp_operator.plan import lora_adapters
from vllm_dp_operator.reconcile.lora_status import replica_lora, summarize

TOKEN = "tok"
SQL, CHAT = Adapter("sql", "/adapters/sql"), Adapter("chat", "o/chat")


class VllmLoraDouble:
    """Test double for vLLM's runtime LoRA API behind the gate, on one head: /v1/models lists
    the base model and the adapters; a load of a path in `missing` fails as vLLM's does."""

    def __init__(self, loaded: Mapping[str, str] | None = None) -> None:
        self.loaded = dict(loaded or {})
        self.missing: set[str] = set()
        self.calls: list[tuple[str, str, Any]] = []
        self.models_status = 200

    async def request(self, method: str, namespace: str, service: str, port: int, path: str,
                      limit: int | None = None, headers: Mapping[str, str] | None = None,
                      json_body: Mapping[str, Any] | None = None) -> Answer:  # fmt: skip
        self.calls.append((method, path, dict(json_body or {})))
        if (headers or {}).get("x-ray-authorization") != f"Bearer {TOKEN}":
            return Answer(403, "{}", "HTTP 403")
        if path == "/v1/models":
            cards = [{"id": "base", "root": "base", "parent": None}] + [
                {"id": n, "root": p, "parent": "base"} for n, p in self.loaded.items()]
            return Answer(self.models_status, json.dumps({"data": cards}),
                          f"HTTP {self.models_status}")  # fmt: skip
        body = dict(json_body or {})
        if path == "/v1/load_lora_adapter":
            if body["lora_path"] in self.missing:
                err = {"error": {"message": f"Loading lora {body['lora_name']} failed: No "
                                 f"adapter found for {body['lora_path']}", "code": 404}}
                return Answer(404, json.dumps(err), "HTTP 404")
            self.loaded[body["lora_name"]] = body["lora_path"]
            return Answer(200, "Success", "HTTP 200")
        if path == "/v1/unload_lora_adapter":
            if self.loaded.pop(body["lora_name"], None) is None:
                return Answer(404, "{}", "HTTP 404")
            return Answer(200, "Success", "HTTP 200")
        return Answer(404, "", "HTTP 404")

    async def close(self) -> None:
        return None

    def writes(self) -> list[tuple[str, Any]]:
        return [(p, b.get("lora_name")) for m, p, b in self.calls if m == "POST"]


async def run(vllm: VllmLoraDouble, wanted: tuple[Adapter, ...],
              previous: LoraState | None = None, retry: bool = True) -> LoraState:  # fmt: skip
    return await sync(vllm, "ns", "head", 8000, TOKEN, wanted, previous, retry)


async def test_loads_what_is_missing_unloads_what_is_dropped_or_moved() -> None:
    vllm = VllmLoraDouble({"old": "/adapters/old", "sql": "/adapters/sql-v1", "chat": "o/chat"})
    state = await run(vllm, (SQL, CHAT))
    assert vllm.loaded == {"sql": "/adapters/sql", "chat": "o/chat"}
    assert sorted(vllm.writes()) == [("/v1/load_lora_adapter", "sql"),
                                     ("/v1/unload_lora_adapter", "old"),
                                     ("/v1/unload_lora_adapter", "sql")]
    assert state.loaded == {"sql", "chat"} and state.settled((SQL, CHAT))


async def test_a_failed_load_is_kept_not_asked_again_until_a_retry_and_the_rest_load() -> None:
    vllm = VllmLoraDouble()
    vllm.missing.add(SQL.path)
    first = await run(vllm, (SQL, CHAT))
    assert first.loaded == {"chat"}
    assert "404: Loading lora sql failed: No adapter found" in first.failed()["sql"]
    assert first.settled((SQL, CHAT))  # tried: a new head may be routed
    vllm.calls.clear()
    again = await run(vllm, (SQL, CHAT), first, retry=False)
    assert vllm.writes() == [] and again.failed() == first.failed()
    vllm.missing.clear()
    fixed = await run(vllm, (SQL, CHAT), again, retry=True)
    assert fixed.loaded == {"sql", "chat"} and fixed.failed() == {}


async def test_a_new_source_for_a_failed_adapter_is_tried_at_once() -> None:
    vllm = VllmLoraDouble()
    vllm.missing.add(SQL.path)
    first = await run(vllm, (SQL,))
    moved = Adapter("sql", "/adapters/sql-v2")
    state = await run(vllm, (moved,), first, retry=False)
    assert state.loaded == {"sql"} and vllm.loaded == {"sql": moved.path}


async def test_an_unreadable_model_list_settles_nothing_and_changes_nothing() -> None:
    vllm = VllmLoraDouble({"old": "/x"})
    vllm.models_status = 503
    state = await run(vllm, (SQL,))
    assert state.detail.startswith("/v1/models: HTTP 503")
    assert not state.settled((SQL,)) and vllm.writes() == []


async def test_the_pool_syncs_after_health_and_again_on_a_new_set_with_no_new_entry() -> None:
    engines, vllm = EngineDouble(), VllmLoraDouble()
    engines.ok["head"] = True
    woken: list[Any] = []
    pool = ProbePool(engines, woken.append, concurrency=2, launching_seconds=0.05,
                     serving_seconds=30, transport=vllm)  # fmt: skip
    target = Target("ns", "vdp", "head", 8000, "job-1", adapters=(SQL,), token=TOKEN)
    task = pool.start()[0]
    try:
        assert pool.adapters(target) is None
        for _ in range(100):
            if (state := pool.adapters(target)) is not None:
                break
            await asyncio.sleep(0.02)
        assert state is not None and state.settled((SQL,))
        health = pool.health(target)
        wider = Target("ns", "vdp", "head", 8000, "job-1", adapters=(SQL, CHAT), token=TOKEN)
        assert wider == target  # the adapters are not the head job's identity
        pool.health(wider)
        for _ in range(100):
            if (state := pool.adapters(wider)) is not None and state.settled((SQL, CHAT)):
                break
            await asyncio.sleep(0.02)
        assert state is not None and state.loaded == {"sql", "chat"}
        assert pool.health(wider) == health  # still the same, probed entry
        assert ("ns", "vdp") in woken
    finally:
        task.cancel()


def test_status_names_where_each_adapter_serves_and_each_new_failure_once() -> None:
    spec = validate("v", {"model": "m", "dataParallel": {"size": 2, "ranksPerNode": 1},
                          "replicas": 2, "lora": {"adapters": [
                              {"name": "sql", "source": {"path": "/adapters/sql"}},
                              {"name": "bad", "source": {"huggingFace": "o/bad"}}]}})
    assert lora_adapters(spec) == (SQL, Adapter("bad", "o/bad"))
    entries = [
        {"index": 0, "routed": True,
         "lora": replica_lora(frozenset({"sql"}), {"bad": "404: not found"}, "")},
        {"index": 1, "routed": True, "lora": replica_lora(frozenset({"sql"}), {}, "")},
        {"index": 2, "routed": False, "leaving": "now", "lora": replica_lora(frozenset(), {}, "")},
    ]
    summary = summarize(spec, entries, None)
    assert summary is not None
    assert summary.status == {"ready": "1/2", "adapters": [
        {"name": "sql", "replicas": [0, 1]},
        {"name": "bad", "replicas": [], "error": "404: not found"}]}
    ok, reason, message = summary.condition
    assert (ok, reason) == (False, "AdapterFailed") and "bad: 404: not found" in message
    assert summary.new_failures == {"bad": "404: not found"}
    again = summarize(spec, entries, summary.status)
    assert again is not None and again.new_failures == {}
    entries[0]["lora"] = replica_lora(frozenset({"sql", "bad"}), {}, "")
    entries[1]["lora"] = replica_lora(frozenset({"sql", "bad"}), {}, "")
    done = summarize(spec, entries, again.status)
    assert done is not None and done.condition[:2] == (True, "AdaptersLoaded")
    assert summarize(validate("v", {"model": "m", "dataParallel": {"size": 2,
                                                                   "ranksPerNode": 1}}),
                     entries, None) is None
