"""vLLM's runtime LoRA endpoints, open to the operator only (`--middleware` of vllm serve).

With VLLM_ALLOW_RUNTIME_LORA_UPDATING set, vLLM serves /v1/load_lora_adapter and
/v1/unload_lora_adapter to anyone who may call /v1 (with the API key where one is set), and
registers the same handlers under /adapters, outside the paths its API-key check guards. This
ASGI middleware, which vLLM 0.33 installs outside its own API-key check, answers 403 to any
call of those paths that does not carry the Ray cluster's token (which only the Ray pods,
KubeRay and the operator hold) in the header the operator sends Ray. A call that does, and
the operator's read of /v1/models, are passed on with the header removed and with the API key
vLLM wants where there is one: the operator holds no API key.
"""

from __future__ import annotations

import json
import os

from vllm_dp_launcher.asgi import TOKEN_HEADER, App, Receive, Scope, Send, carries_token
from vllm_dp_launcher.asgi import normal_path as _normal

#: What vllm serve is given: the middleware's import path, and the variable that turns vLLM's
#: runtime LoRA endpoints on.
MIDDLEWARE = "vllm_dp_launcher.lora_gate.LoraGate"
RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
GATED = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
GATED_PREFIX = "/adapters"


#: The model list the operator reads the loaded adapters from; with the token, it gets the API
#: key too.
LISTED = "/v1/models"


def gated(path: str) -> bool:
    """Whether a request path changes the served adapters."""
    path = _normal(path)
    return path in GATED or path == GATED_PREFIX or path.startswith(GATED_PREFIX + "/")


class LoraGate:
    """Refuses adapter changes without the Ray token; lets everything else through."""

    def __init__(self, app: App, token: str | None = None, api_key: str | None = None) -> None:
        self.app = app
        self._token = (token if token is not None else os.environ.get("RAY_AUTH_TOKEN", ""))
        self._api_key = api_key if api_key is not None else os.environ.get("VLLM_API_KEY", "")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = str(scope.get("path", ""))
        if scope.get("type") != "http" or not (gated(path) or _normal(path) == LISTED):
            await self.app(scope, receive, send)
            return
        headers = list(scope.get("headers") or [])
        if not carries_token(headers, self._token):
            if gated(path):
                await _refuse(send)
            else:  # a client's own model list: as vLLM answers it
                await self.app(scope, receive, send)
            return
        kept = [(k, v) for k, v in headers
                if k.lower() not in (TOKEN_HEADER, b"authorization")]  # fmt: skip
        if self._api_key:
            kept.append((b"authorization", f"Bearer {self._api_key}".encode()))
        await self.app({**scope, "headers": kept}, receive, send)


async def _refuse(send: Send) -> None:
    body = json.dumps({"error": {
        "message": "adapters are loaded and unloaded by the vllm-dp-operator only: set them "
                   "in the resource's spec.lora.adapters",
        "type": "Forbidden", "param": None, "code": 403}}).encode()  # fmt: skip
    await send({"type": "http.response.start", "status": 403,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})
