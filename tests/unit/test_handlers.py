"""The kopf handlers' own decisions: a namespace being deleted is nothing to do, quietly."""

from __future__ import annotations

import json
import logging
from typing import Any

import kopf
from fake_kube import FakeKube
from kubernetes_asyncio.client.exceptions import ApiException
from vllm_dp_operator import handlers
from vllm_dp_operator.kube import _namespace_terminating
from vllm_dp_operator.probe import ProbeResult
from vllm_dp_operator.ray_dashboard import NOT_FOUND, RayJobLookup, StopResult


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


class _Probe:
    async def check(self, namespace: str, service: str, port: int) -> ProbeResult:
        return ProbeResult(False, "no")


class _Jobs:
    async def lookup(self, namespace: str, cluster: str, submission_id: str) -> RayJobLookup:
        return RayJobLookup(NOT_FOUND, "none")

    async def stop(self, namespace: str, cluster: str, submission_id: str) -> StopResult:
        return StopResult(False, "none")


async def test_reconcile_in_a_terminating_namespace_is_nothing_to_do() -> None:
    kube = FakeKube()
    kube.terminating.add("gone")
    memo = kopf.Memo()
    memo.kube, memo.probe, memo.ray_jobs, memo.locks = kube, _Probe(), _Jobs(), {}
    body = kopf.Body({"metadata": {"name": "demo", "namespace": "gone", "uid": "u1"},
                      "spec": {"model": "m", "dataParallel": {"size": 4, "ranksPerNode": 2}}})
    patch = kopf.Patch()
    logger = logging.getLogger("test")
    await handlers._run(body, patch, memo, logger)  # no traceback, no retry
    assert kube.calls["create"] == 1 and kube.objects == {}
    assert dict(patch) == {}  # no status written for a resource about to vanish
