"""The launcher's gate in front of vLLM's runtime LoRA endpoints (vllm_dp_launcher.lora_gate)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from vllm_dp_launcher.lora_gate import LoraGate, gated

TOKEN = "tok-123"


class Inner:
    """Stands in for vLLM's app behind the middleware: records what reached it."""

    def __init__(self) -> None:
        self.scopes: list[dict[str, Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.scopes.append(dict(scope))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def call(gate: LoraGate, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, bytes]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await gate({"type": "http", "path": path, "headers": headers}, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


@pytest.mark.parametrize("path", ["/v1/load_lora_adapter", "/v1/unload_lora_adapter/",
                                  "/adapters", "/adapters/sql", "//v1/load_lora_adapter"])
def test_adapter_changes_are_gated(path: str) -> None:
    assert gated(path)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/models", "/health", "/metrics",
                                  "/adaptersx", "/v1/load_lora_adapterx"])
def test_everything_else_passes(path: str) -> None:
    assert not gated(path)


async def test_a_change_without_the_token_is_refused_and_never_reaches_vllm() -> None:
    inner = Inner()
    gate = LoraGate(inner, token=TOKEN, api_key="sk-1")
    for headers in ([], [(b"authorization", b"Bearer sk-1")],
                    [(b"x-ray-authorization", b"Bearer wrong")],
                    [(b"x-ray-authorization", f"Bearer {TOKEN}x".encode())]):
        status, body = await call(gate, "/v1/load_lora_adapter", headers)
        assert status == 403
        assert "spec.lora.adapters" in json.loads(body)["error"]["message"]
    assert inner.scopes == []


async def test_with_no_token_in_the_pod_every_change_is_refused() -> None:
    inner = Inner()
    status, _ = await call(LoraGate(inner, token="", api_key=""), "/adapters",
                           [(b"x-ray-authorization", b"Bearer ")])
    assert status == 403
    assert inner.scopes == []


async def test_the_operators_call_passes_with_the_api_key_and_without_its_token() -> None:
    inner = Inner()
    gate = LoraGate(inner, token=TOKEN, api_key="sk-1")
    status, _ = await call(gate, "/v1/load_lora_adapter",
                           [(b"X-Ray-Authorization", f"Bearer {TOKEN}".encode()),
                            (b"authorization", b"Bearer forged"),
                            (b"content-type", b"application/json")])
    assert status == 200
    [scope] = inner.scopes
    assert scope["headers"] == [(b"content-type", b"application/json"),
                                (b"authorization", b"Bearer sk-1")]


async def test_without_an_api_key_no_authorization_is_added() -> None:
    inner = Inner()
    gate = LoraGate(inner, token=TOKEN, api_key="")
    status, _ = await call(gate, "/v1/unload_lora_adapter",
                           [(b"x-ray-authorization", f"Bearer {TOKEN}".encode())])
    assert status == 200
    assert inner.scopes[0]["headers"] == []


async def test_other_requests_pass_untouched() -> None:
    inner = Inner()
    headers = [(b"authorization", b"Bearer client"), (b"x-ray-authorization", b"anything")]
    status, _ = await call(LoraGate(inner, token=TOKEN), "/v1/completions", headers)
    assert status == 200
    assert inner.scopes[0]["headers"] == headers


async def test_the_operators_model_list_gets_the_api_key_a_clients_passes_as_it_is() -> None:
    inner = Inner()
    gate = LoraGate(inner, token=TOKEN, api_key="sk-1")
    assert (await call(gate, "/v1/models", [(b"x-ray-authorization",
                                             f"Bearer {TOKEN}".encode())]))[0] == 200
    assert inner.scopes[0]["headers"] == [(b"authorization", b"Bearer sk-1")]
    client = [(b"authorization", b"Bearer guess"), (b"x-ray-authorization", b"Bearer no")]
    assert (await call(gate, "/v1/models", client))[0] == 200
    assert inner.scopes[1]["headers"] == client  # vLLM's own key check answers it
