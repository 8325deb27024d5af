"""The adapters one head serves, brought to what the spec asks through vLLM's runtime LoRA API.

One sync reads /v1/models (the adapters vLLM's API server lists, each with its path as `root`
and the base model as `parent`), unloads what the spec no longer names (or names with another
source), and loads what it names and vLLM does not list. vLLM's DP client sends a load to
every engine of its DP group (DPLBAsyncMPClient broadcasts utility calls), and answers only
once all took it, so a listed adapter is on every rank.

The calls carry the Ray cluster's token in the header the operator sends Ray: the launcher's
gate in front of vLLM (vllm_dp_launcher/lora_gate.py) takes adapter changes only with it, and
adds the API key vLLM wants where there is one. A failed load keeps vLLM's answer as the
adapter's error, is not asked again until `retry_seconds` have passed or its source changes,
and never stops the base model or the other adapters serving.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from vllm_dp_operator import constants
from vllm_dp_operator.engines.transport import Answer, ServiceTransport

#: At most this much of /v1/models is read (a card per adapter, a few hundred bytes each).
MODELS_MAX_BYTES = 1024 * 1024
#: At most this much of a load's or unload's answer is kept as an error.
ERROR_MAX_CHARS = 300


@dataclass(frozen=True)
class Adapter:
    """An adapter the spec asks for: its served name and the path vLLM loads it from (a
    directory in the head container, or a Hugging Face repo id vLLM downloads)."""

    name: str
    path: str


@dataclass(frozen=True)
class LoraState:
    """What one sync found and did on one head."""

    #: The adapters it synced to.
    wanted: tuple[Adapter, ...]
    #: The adapters vLLM lists after it, by name.
    loaded: frozenset[str] = frozenset()
    #: Adapters whose last load failed (none vLLM lists), with vLLM's answer and the path it
    #: was asked for.
    errors: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    #: Why the adapters could not be read at all ("" when they were).
    detail: str = ""

    def settled(self, wanted: tuple[Adapter, ...]) -> bool:
        """Whether this sync was of `wanted`, and every adapter of it was tried: loaded, or
        failed with its error kept. Until then a new head is not routed."""
        if self.detail or self.wanted != wanted:
            return False
        return all(a.name in self.loaded or a.name in self.errors for a in wanted)

    def failed(self) -> dict[str, str]:
        """Each adapter that did not load, and why."""
        return {name: why for name, (why, _) in self.errors.items()}


def _loaded(answer: Answer) -> dict[str, str] | None:
    """The adapters of a /v1/models answer (cards with a `parent`), name to path."""
    try:
        cards = json.loads(answer.body).get("data") or []
    except (ValueError, AttributeError):
        return None
    return {str(c["id"]): str(c.get("root") or "") for c in cards
            if isinstance(c, dict) and c.get("parent") and "id" in c}  # fmt: skip


def _why(answer: Answer) -> str:
    """vLLM's error message for a failed call, else the transport's detail."""
    try:
        message = str(json.loads(answer.body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = answer.body.strip()
    status = answer.status if answer.status is not None else "no answer"
    text = f"{status}: {message}" if message else answer.detail
    return text[:ERROR_MAX_CHARS]


async def sync(
    transport: ServiceTransport, namespace: str, service: str, port: int, token: str,
    wanted: tuple[Adapter, ...], previous: LoraState | None, retry_failed: bool,
) -> LoraState:  # fmt: skip
    """Bring the head's adapters to `wanted`; what vLLM lists afterwards."""
    headers = {constants.RAY_AUTH_HEADER: f"Bearer {token}"}

    async def call(method: str, path: str, body: dict[str, str] | None = None) -> Answer:
        return await transport.request(method, namespace, service, port, path,
                                       limit=MODELS_MAX_BYTES, headers=headers,
                                       json_body=body)  # fmt: skip

    answer = await call("GET", "/v1/models")
    listed = _loaded(answer) if answer.ok else None
    old_errors = dict(previous.errors) if previous is not None else {}
    if listed is None:
        why = answer.detail if not answer.ok else f"{answer.detail}: not a model list"
        return LoraState(wanted, frozenset(), old_errors, f"/v1/models: {why}")
    paths = {a.name: a.path for a in wanted}
    for name, root in list(listed.items()):
        if paths.get(name) != root:  # no longer asked for, or asked from another source
            gone = await call("POST", "/v1/unload_lora_adapter", {"lora_name": name})
            if gone.ok or gone.status == 404:
                listed.pop(name)
    errors: dict[str, tuple[str, str]] = {}
    for a in wanted:
        if a.name in listed:
            continue
        last = old_errors.get(a.name)
        if last is not None and last[1] == a.path and not retry_failed:
            errors[a.name] = last  # failed from this source: not asked again until a retry
            continue
        done = await call("POST", "/v1/load_lora_adapter",
                          {"lora_name": a.name, "lora_path": a.path})  # fmt: skip
        if done.ok or (done.status == 400 and "already been loaded" in done.body):
            listed[a.name] = a.path
        else:
            errors[a.name] = (_why(done), a.path)
    return LoraState(wanted, frozenset(listed), errors)
