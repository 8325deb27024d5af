"""Watch faults: a watch the API server closes is resumed without losing an event, and a watch
whose resourceVersion has expired (410 Gone) relists and still acts on a change made in the gap.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import faults
import pytest
from fleet import converged, explain, get, own_nodes, small
from kubernetes_asyncio import client, config
from operator_proc import OperatorProcess
from vllm_dp_operator import constants as c
from vllm_dp_operator.controller.cache import MANAGED_SELECTOR, Obj, ObjectCache
from vllm_dp_operator.controller.informer import Reflector
from vllm_dp_operator.controller.kube import SERVICE, ApiKube

pytestmark = pytest.mark.reliability


def _service(ns: str, name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": ns,
                         "labels": {c.LABEL_MANAGED_BY: c.MANAGER}},
            "spec": {"ports": [{"port": 80}]}}  # fmt: skip


async def _reflect_across_server_timeouts(testbed: Any, ns: str) -> tuple[Reflector, set[str]]:
    await config.load_kube_config(str(testbed.kubeconfig))
    async with client.ApiClient() as raw:
        api = ApiKube(raw)
        cache = ObjectCache((SERVICE,))
        changed: list[Obj] = []
        # The server ends each watch after 1-2 s (timeoutSeconds), as it does after 5-10 min.
        reflector = Reflector(api, cache, SERVICE, ns, MANAGED_SELECTOR, changed.append,
                              watch_seconds=(1, 2))  # fmt: skip
        task = asyncio.create_task(reflector.run())
        try:
            await asyncio.wait_for(reflector.synced.wait(), 30)
            for i in range(8):  # a change now and then, across several watches
                await api.create(SERVICE, ns, _service(ns, f"s{i}"))
                if i % 3 == 2:
                    await api.delete(SERVICE, ns, f"s{i - 1}")
                await asyncio.sleep(0.7)
            await asyncio.sleep(2.5)  # let the last watch end and resume once more
        finally:
            task.cancel()
        ours = cache.select(SERVICE, ns, {c.LABEL_MANAGED_BY: c.MANAGER})
        names = {o["metadata"]["name"] for o in ours}
        return reflector, names


def test_watch_closed_by_the_server_resumes_without_losing_a_change(
    testbed: Any, testbed_namespace: str
) -> None:
    reflector, names = asyncio.run(_reflect_across_server_timeouts(testbed, testbed_namespace))
    assert reflector.watches >= 4, "the server did not end the watches"
    assert reflector.lists == 1, "a resumed watch relisted: it lost its place"
    assert names == {f"s{i}" for i in range(8)} - {"s1", "s4"}, names


def test_watch_resumed_after_410_relists_and_acts_on_a_change_made_in_the_gap(
    testbed: Any, testbed_namespace: str, operator: OperatorProcess
) -> None:
    """The operator is frozen (SIGSTOP) while the API server restarts: its watches' last
    resourceVersion predates the new server's watch cache, so resuming them answers 410 Gone.
    A Service deleted in that gap has no DELETED event to deliver; only the relist's diff
    against the cache finds it."""
    ns = testbed_namespace
    assert operator.proc is not None
    with own_nodes(testbed, ns, gpus=2):
        testbed.apply(small(ns, "gap"))
        testbed.wait_until("gap to converge", lambda: converged(testbed, ns, 1), timeout=90)
        uid = testbed.kubectl_json("-n", ns, "get", "service", "gap-api")["metadata"]["uid"]
        operator.proc.send_signal(signal.SIGSTOP)
        try:
            # Move the store's revision on, so the operator's resourceVersions are old ones.
            for i in range(5):
                testbed.kubectl("-n", ns, "create", "configmap", f"tick{i}")
            faults.restart(testbed.state_dir, "kube-apiserver", 1, crash=True)
            testbed.kubectl("-n", ns, "delete", "service", "gap-api", "--wait=true")
        finally:
            operator.proc.send_signal(signal.SIGCONT)
        try:
            testbed.wait_until("gap-api to be made again", lambda: any(
                s["metadata"]["name"] == "gap-api" and s["metadata"]["uid"] != uid
                for s in get(testbed, ns, "services")), timeout=60)  # fmt: skip
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{explain(testbed, ns, operator)}") from exc
        log = operator.log_tail(10**7)
        assert "resourceVersion expired; relisting" in log, log[-4000:]
