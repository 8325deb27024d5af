"""The Ray dashboard's job API on the head pod: is a head job's Ray job still alive, stop it.

KubeRay's RayJob finalizer calls the same stop endpoint, but removes itself whether or not
the stop worked, and skips it once the RayJob's status is terminal. The operator asks and
stops on its own, and starts the next launch only when the old Ray job has ended.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import quote

from vllm_dp_operator import constants
from vllm_dp_operator.api import names
from vllm_dp_operator.engines.transport import Answer, ServiceTransport

# Ray job statuses (ray.dashboard.modules.job.common.JobStatus) in which no process runs.
ENDED_STATUSES = frozenset({"STOPPED", "SUCCEEDED", "FAILED"})
NOT_FOUND = "NOT_FOUND"  # the dashboard does not know the job: never submitted, or lost
UNKNOWN = "UNKNOWN"  # the dashboard did not answer


@dataclass(frozen=True)
class RayJobLookup:
    """What the dashboard says of one Ray job."""

    state: str  # a Ray job status, NOT_FOUND or UNKNOWN
    detail: str

    @property
    def ended(self) -> bool:
        """No process of the job runs: it ended, or this head has never known it."""
        return self.state in ENDED_STATUSES or self.state == NOT_FOUND


@dataclass(frozen=True)
class StopResult:
    """Whether the dashboard took a stop request."""

    delivered: bool
    detail: str


class RayJobs(Protocol):
    """The part of the Ray job API the operator uses."""

    async def lookup(
        self, namespace: str, cluster: str, submission_id: str, token: str | None
    ) -> RayJobLookup:
        """The status of one Ray job on the cluster's head (`token`: the cluster's Ray auth
        token, None where the cluster has none)."""
        ...

    async def stop(
        self, namespace: str, cluster: str, submission_id: str, token: str | None
    ) -> StopResult:
        """Ask the head to stop one Ray job (SIGTERM, then SIGKILL after its wait time)."""
        ...


class DashboardJobs:
    """RayJobs over the dashboard port of KubeRay's head Service."""

    def __init__(self, transport: ServiceTransport) -> None:
        self._transport = transport

    async def lookup(
        self, namespace: str, cluster: str, submission_id: str, token: str | None
    ) -> RayJobLookup:
        """GET /api/jobs/<submission_id>."""
        answer = await self._transport.request(
            "GET", namespace, names.head_service(cluster), constants.RAY_DASHBOARD_PORT,
            f"/api/jobs/{quote(submission_id, safe='')}", headers=_auth(token),
        )  # fmt: skip
        if answer.status == 404:
            return RayJobLookup(NOT_FOUND, answer.detail)
        if answer.status == 200:
            try:
                state = str(json.loads(answer.body)["status"])
            except (ValueError, KeyError, TypeError):
                return RayJobLookup(UNKNOWN, f"{answer.detail}: not a Ray job: {answer.body!r}")
            return RayJobLookup(state, f"{answer.detail}: Ray job {state}")
        return RayJobLookup(UNKNOWN, _refusal(answer))

    async def stop(
        self, namespace: str, cluster: str, submission_id: str, token: str | None
    ) -> StopResult:
        """POST /api/jobs/<submission_id>/stop."""
        answer = await self._transport.request(
            "POST", namespace, names.head_service(cluster), constants.RAY_DASHBOARD_PORT,
            f"/api/jobs/{quote(submission_id, safe='')}/stop", headers=_auth(token),
        )  # fmt: skip
        return StopResult(answer.ok, _refusal(answer))


def _auth(token: str | None) -> dict[str, str] | None:
    # KubeRay's header (dashboard_httpclient.go): through the API server's service proxy the
    # `Authorization` header is the API server's own, so Ray also reads this one.
    return {constants.RAY_AUTH_HEADER: f"Bearer {token}"} if token else None


def _refusal(answer: Answer) -> str:
    """The answer's detail, saying so when Ray's token check refused the operator."""
    if answer.status in (401, 403):
        return (f"{answer.detail}: the Ray dashboard refused the operator's token (was the "
                "operator's Ray auth key changed, or the token Secret replaced?)")  # fmt: skip
    return answer.detail
