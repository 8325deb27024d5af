"""Rotating the operator's Ray auth key, as docs/security.md ("Rotating the Ray auth key") says.

Three resources serve (kwok GPU nodes of their own, vLLM's /health double in the pod
network). The operator is restarted with a new key and the old one as `previous`: nothing is
replaced, since it still derives the old clusters' tokens. Each resource is restarted
(`vllmdp.io/restartedAt`), as the procedure's second step: each serves again from a new
RayCluster whose token Secret names the new key id and holds a token none of the old clusters
had, and no cluster of an old token is left, so an old token opens no dashboard (Ray compares
the token with its cluster's Secret: tests/cluster's dashboard test). Then the operator runs
with the new key alone: every resource stays Serving and nothing is replaced. The time from
the restarts to every resource serving again is printed.
"""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path
from typing import Any

import pytest
from fleet import get, own_nodes, small
from operator_proc import OperatorProcess, install_crd
from scenario import double_in_pod_network
from vllm_dp_operator import constants as c
from vllm_dp_operator.engines.ray_auth import key_id

pytestmark = pytest.mark.reliability

COUNT = 3


def live_clusters(testbed: Any, ns: str) -> dict[str, tuple[str, str]]:
    """Each resource's live RayCluster: (uid, its token Secret)."""
    out = {}
    for cl in get(testbed, ns, "rayclusters"):
        meta = cl["metadata"]
        if not meta.get("deletionTimestamp"):
            out[meta["labels"][c.LABEL_INSTANCE]] = (
                meta["uid"], cl["spec"]["authOptions"]["secretName"])  # fmt: skip
    return out


def token(testbed: Any, ns: str, secret: str) -> str:
    """A Secret's token, read as an admin reads it (the operator never does)."""
    raw = testbed.kubectl("-n", ns, "get", "secret", secret, "-o",
                          "jsonpath={.data.auth_token}").stdout  # fmt: skip
    return base64.b64decode(raw).decode()


def serving(testbed: Any, ns: str) -> set[str]:
    return {o["metadata"]["name"] for o in get(testbed, ns, "vdp")
            if (o.get("status") or {}).get("phase") == "Serving"
            and o["status"].get("readyReplicas") == 1 and not o["status"].get("rollout")}


def start(testbed: Any, ns: str, log: Path, key: Path, previous: Path | None = None
          ) -> OperatorProcess:  # fmt: skip
    env = {"VLLMDP_RAY_AUTH_KEY_FILE": str(key),
           "VLLMDP_RAY_AUTH_PREVIOUS_KEY_FILE": str(previous or key.with_name("absent"))}
    op = OperatorProcess(testbed.env(), log, env)
    op.namespace = ns
    op.start()
    return op


def wait(testbed: Any, op: OperatorProcess, what: str, check: Any, timeout: float) -> None:
    """Poll every second; a timeout says what the operator logged last."""
    try:
        testbed.wait_until(what, check, timeout=timeout, interval=1)
    except AssertionError as err:
        raise AssertionError(f"{err}\noperator log:\n{op.log_tail()}") from None


def hold_unchanged(testbed: Any, ns: str, op: OperatorProcess, before: dict[str, Any],
                   seconds: float) -> None:  # fmt: skip
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        now = live_clusters(testbed, ns)
        assert now == before, f"replaced: {before} -> {now}\n{op.log_tail()}"
        time.sleep(2)
    assert len(serving(testbed, ns)) == COUNT, op.log_tail()


def test_a_key_rotation_moves_every_resource_to_the_new_key_and_old_tokens_open_nothing(
    testbed: Any, testbed_namespace: str, tmp_path: Path
) -> None:
    ns, log = testbed_namespace, tmp_path / "operator.log"
    old_key, new_key = tmp_path / "old", tmp_path / "new"
    old_key.write_bytes(os.urandom(32).hex().encode())
    new_key.write_bytes(os.urandom(32).hex().encode())
    old_id, new_id = key_id(old_key.read_bytes()), key_id(new_key.read_bytes())
    install_crd(testbed)
    names = [f"k{i}" for i in range(COUNT)]
    with own_nodes(testbed, ns, COUNT * 4), \
            double_in_pod_network(testbed, "health_server.py", 8000):  # fmt: skip
        op = start(testbed, ns, log, old_key)
        try:
            testbed.apply([small(ns, n) for n in names])
            wait(testbed, op, f"{COUNT} resources Serving",
                 lambda: len(serving(testbed, ns)) == COUNT, 300)
            before = live_clusters(testbed, ns)
            assert all(f"-ray-token-{old_id}" in secret for _, secret in before.values()), before
            old_tokens = {token(testbed, ns, secret) for _, secret in before.values()}
            assert len(old_tokens) == COUNT
        finally:
            op.stop()

        # Step 1: the new key, the old one as `previous`; the operator restarted.
        op = start(testbed, ns, log, new_key, old_key)
        try:
            hold_unchanged(testbed, ns, op, before, 20)
            # Step 2: restart every resource.
            started = time.monotonic()
            for name in names:
                testbed.kubectl("-n", ns, "annotate", "vdp", name,
                                f"{c.ANNOTATION_RESTARTED_AT}=2026-12-07T07:00:00Z")

            def moved() -> bool:
                now = live_clusters(testbed, ns)
                return (set(now) == set(names) and serving(testbed, ns) == set(names)
                        and all(f"-ray-token-{new_id}" in secret for _, secret in now.values())
                        and not any(uid == before[n][0] for n, (uid, _) in now.items()))

            wait(testbed, op, "every resource serving from a cluster of the new key", moved, 300)
            took = time.monotonic() - started
            after = live_clusters(testbed, ns)
            new_tokens = {token(testbed, ns, secret) for _, secret in after.values()}
            assert len(new_tokens) == COUNT and not new_tokens & old_tokens
            left = [cl["metadata"]["name"] for cl in get(testbed, ns, "rayclusters")
                    if f"-ray-token-{old_id}" in cl["spec"]["authOptions"]["secretName"]
                    and not cl["metadata"].get("deletionTimestamp")]  # fmt: skip
            assert left == [], f"clusters of the old key left: {left}"
            print(f"\n[rotation] {COUNT} resources serving from clusters of key {new_id} "
                  f"{took:.1f} s after their restart (Surge, one update slot)")
        finally:
            op.stop()

        # Step 3: the previous key removed; the operator restarted. Nothing moves.
        op = start(testbed, ns, log, new_key)
        try:
            hold_unchanged(testbed, ns, op, after, 20)
        finally:
            op.stop()
