"""Why a reflector cannot list or watch its kind, in words, and what that means for resources.

A child kind the API server does not serve (404: KubeRay not installed, or its CRDs at another
version) or does not let the operator read (403: RBAC) cannot be fixed by retrying faster; the
operator must say so. These pure functions name the kind and the cause; the reflector keeps
retrying and logs each cause once (`informer.py`), and the controller turns the causes into
readiness, a metric, and a condition on every resource it cannot serve (`manager.py`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException

from vllm_dp_operator import constants as c
from vllm_dp_operator.controller.kube import Kind
from vllm_dp_operator.reconcile.status import condition_status, set_condition


@dataclass(frozen=True)
class WatchProblem:
    """Why the latest LIST or WATCH of one kind failed."""

    reason: str  # a condition reason, or UNREACHABLE / API_ERROR for transient ones
    message: str
    #: 404 and 403: no resource can be served until someone fixes the cluster. Other failures
    #: (the API server restarting, a timeout) pass by themselves and the cache stays usable.
    blocks: bool

    @property
    def not_served(self) -> bool:
        """A 404: the API server does not serve the kind at all."""
        return self.reason == c.REASON_KIND_NOT_SERVED

    @property
    def cause(self) -> str:
        """What a log line is about: the same cause is logged once, not at every retry."""
        return f"{self.reason}: {self.message}"


#: Reasons of transient failures (metric labels; never a condition).
UNREACHABLE = "Unreachable"
API_ERROR = "ApiError"


def kind_name(kind: Kind) -> str:
    """A kind as `kubectl api-resources` names it: rayclusters.ray.io/v1, pods/v1."""
    resource = f"{kind.plural}.{kind.group}" if kind.group else kind.plural
    return f"{resource}/{kind.version}"


def _scope(namespace: str | None) -> str:
    return f"in namespace {namespace}" if namespace else "in all namespaces"


def _server_message(exc: ApiException) -> str:
    """The message of the Status the API server answered (body, or a watch's reason text)."""
    for text in (exc.body, exc.reason):
        try:
            doc = json.loads(text or "")
        except (TypeError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("message"):
            return str(doc["message"])
    return str(exc.reason or "")[:300]


def diagnose(kind: Kind, verb: str, namespace: str | None, exc: BaseException) -> WatchProblem:
    """Name the kind and the cause of one failed LIST or WATCH (`verb`)."""
    name = kind_name(kind)
    if isinstance(exc, ApiException) and exc.status == 404:
        hint = (f": is KubeRay installed, with CRDs that serve {kind.group}/{kind.version}?"
                if kind.group == c.RAY_GROUP else "")  # fmt: skip
        return WatchProblem(c.REASON_KIND_NOT_SERVED,
                            f"{name} is not served by the API server{hint}", True)  # fmt: skip
    if isinstance(exc, ApiException) and exc.status == 403:
        resource = name.rsplit("/", 1)[0]
        said = _server_message(exc)
        return WatchProblem(
            c.REASON_WATCH_FORBIDDEN,
            f"RBAC forbids the operator to {verb} {resource} {_scope(namespace)}: grant its "
            f"ServiceAccount list and watch on {resource} (the chart's RBAC does)"
            + (f"; the API server said: {said}" if said else ""),
            True,
        )  # fmt: skip
    if isinstance(exc, ApiException):
        return WatchProblem(API_ERROR, f"{verb} {name}: HTTP {exc.status} {_server_message(exc)}"
                            .strip(), False)  # fmt: skip
    kind_of = type(exc).__name__
    detail = str(exc)[:300] if isinstance(exc, aiohttp.ClientError | ValueError) else ""
    return WatchProblem(UNREACHABLE, f"{verb} {name}: {kind_of} {detail}".strip(), False)


def unserved_message(problems: Iterable[WatchProblem]) -> str:
    """What a resource is told while some child kind cannot be read."""
    said = "; ".join(p.message for p in problems)
    end = "" if said.endswith(("?", ".")) else "."
    return (f"The operator cannot serve this resource: {said}{end} It retries by itself and "
            "reconciles as soon as it can read every kind it manages.")  # fmt: skip


def unserved_status(
    status: Mapping[str, Any], problems: list[WatchProblem], generation: int, now: datetime
) -> dict[str, Any]:
    """The status keys that say a resource cannot be served: the condition and the message.

    The phase stays what it was: what the engines do is not known, and not changed, meanwhile.
    """
    message = unserved_message(problems)
    conditions = set_condition(status.get("conditions") or [], c.COND_CHILDREN_WATCHED, False,
                               problems[0].reason, message, generation, now)  # fmt: skip
    return {"conditions": conditions, "message": message}


def watched_again(
    conditions: list[dict[str, Any]], generation: int, now: datetime
) -> list[dict[str, Any]] | None:
    """The conditions with ChildrenWatched back to True, or None when it was never False.

    Only a resource once told it could not be served carries the condition at all.
    """
    if condition_status(conditions, c.COND_CHILDREN_WATCHED) in (None, "True"):
        return None
    return set_condition(conditions, c.COND_CHILDREN_WATCHED, True, c.REASON_WATCHING,
                         "Every kind the operator manages is listed and watched", generation,
                         now)  # fmt: skip
