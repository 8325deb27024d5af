"""An operator started while the API server's RBAC is still loading waits to be served."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes_asyncio.client.exceptions import ApiException
from vllm_dp_operator.controller.api_ready import wait_until_served
from vllm_dp_operator.controller.kube import Kind


class StartingApi:
    """Refuses the LIST `refusals` times with `status` (403: roles not loaded), then serves."""

    def __init__(self, refusals: int, status: int = 403) -> None:
        self.refusals, self.status = refusals, status
        self.lists: list[str | None] = []

    async def list_page(self, kind: Kind, namespace: str | None, selector: str, limit: int,
                        cont: str | None, fields: str = "") -> dict[str, Any]:  # fmt: skip
        if self.refusals:
            self.refusals -= 1
            raise ApiException(status=self.status, reason="Forbidden")
        self.lists.append(namespace)
        return {"items": []}

    def watch(self, kind: Kind, namespace: str | None, selector: str, resource_version: str,
              timeout_seconds: int, fields: str = "") -> AsyncIterator[dict[str, Any]]:  # fmt: skip
        raise AssertionError("waiting to be served never watches")


async def no_sleep(_: float) -> None:
    return None


async def test_a_list_refused_while_rbac_loads_is_waited_out_and_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    api = StartingApi(refusals=3)
    with caplog.at_level(logging.INFO):
        tries = await wait_until_served(api, sleep=no_sleep)
    assert tries == 4
    assert api.lists == [None]  # all namespaces
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "RBAC forbids the operator to list vllmdataparallels" in warnings[0].getMessage()
    assert "after 4 tries" in caplog.text


async def test_each_watched_namespace_must_list_the_kind() -> None:
    api = StartingApi(refusals=1, status=404)  # the CRD not served yet
    assert await wait_until_served(api, ("a", "b"), sleep=no_sleep) == 2
    assert api.lists == ["a", "b"]


async def test_a_served_api_costs_one_try_and_no_log(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        assert await wait_until_served(StartingApi(refusals=0), sleep=no_sleep) == 1
    assert caplog.text == ""
