"""An operator started while the API server's RBAC is still loading waits to be served."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from kubernetes_asyncio.client.exceptions import ApiException
from vllm_dp_operator.controller.api_ready import wait_until_served
from vllm_dp_operator.controller.kube import Kind


class StartingApi:
    """Refuses discovery `refusals` times (403: roles not loaded), then serves."""

    def __init__(self, refusals: int, list_refusals: int = 0) -> None:
        self.refusals, self.list_refusals = refusals, list_refusals
        self.lists: list[str | None] = []

    async def get_path(self, path: str) -> dict[str, Any]:
        if self.refusals:
            self.refusals -= 1
            raise ApiException(status=403, reason="Forbidden")
        return {"kind": "APIVersions" if path == "/api" else "APIGroupList"}

    async def list_page(self, kind: Kind, namespace: str | None, selector: str, limit: int,
                        cont: str | None) -> dict[str, Any]:  # fmt: skip
        if self.list_refusals:
            self.list_refusals -= 1
            raise ApiException(status=404, reason="Not Found")
        self.lists.append(namespace)
        return {"items": []}


async def no_sleep(_: float) -> None:
    return None


async def test_discovery_refused_while_rbac_loads_is_waited_out_and_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    api = StartingApi(refusals=3)
    with caplog.at_level(logging.INFO):
        tries = await wait_until_served(api, sleep=no_sleep)
    assert tries == 4
    assert api.lists == [None]  # all namespaces
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "403" in warnings[0].getMessage()
    assert "after 4 tries" in caplog.text


async def test_each_watched_namespace_must_list_the_kind() -> None:
    api = StartingApi(refusals=0, list_refusals=1)  # the CRD not served yet: 404
    assert await wait_until_served(api, ("a", "b"), sleep=no_sleep) == 2
    assert api.lists == ["a", "b"]


async def test_a_served_api_costs_one_try_and_no_log(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        assert await wait_until_served(StartingApi(refusals=0), sleep=no_sleep) == 1
    assert caplog.text == ""
