"""Network preflight: every GPU node must reach a ZMQ socket on the launcher's node.

vLLM's API server binds ZMQ sockets on ``tcp://<data-parallel address>:<random port>`` and
engine actors on every node connect to them. If a node cannot reach that address (a network
policy, a wrong interface), vLLM hangs during start-up with no hint of which node is cut off.
This check reproduces the pattern before vLLM starts: a ROUTER bound on an ephemeral port of
the launcher's node IP, and a DEALER in a Ray task pinned (``node:<ip>``) to each GPU node.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from vllm_dp_launcher.cluster import GpuNode
from vllm_dp_launcher.errors import PreflightError

log = logging.getLogger(__name__)


def _endpoint_host(ip: str) -> str:
    """Return the host part of a ZMQ TCP endpoint (IPv6 addresses in brackets)."""
    return f"[{ip}]" if ":" in ip else ip


def _answer_hellos(router: Any, token: bytes, heard: set[str], wait_ms: int) -> None:
    """Answer every probe hello waiting on the ROUTER, remembering which nodes said hello."""
    import zmq

    while router.poll(wait_ms, zmq.POLLIN):
        wait_ms = 0
        frames = router.recv_multipart()
        if len(frames) >= 3 and frames[1] == token:
            router.send_multipart([frames[0], token])
            heard.add(frames[2].decode(errors="replace"))


def run_preflight(
    own_ip: str,
    nodes: list[GpuNode],
    timeout: float,
    clock: Callable[[], float] = time.monotonic,
    cancelled: Callable[[], bool] = lambda: False,
) -> None:
    """Check that every GPU node reaches this node over ZMQ; raise naming any that fail.

    Once ``cancelled()`` (a stop arrived beside it), its tasks are cancelled and it returns
    with no verdict: the launcher must not exit while this uses its Ray connection.
    """
    import ray
    import zmq
    from ray import cloudpickle

    from vllm_dp_launcher import probe

    # By value, so that worker pods need not have this package installed.
    cloudpickle.register_pickle_by_value(probe)  # type: ignore[no-untyped-call]
    token = secrets.token_hex(8)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    if ":" in own_ip:
        router.setsockopt(zmq.IPV6, 1)
    try:
        port = router.bind_to_random_port(f"tcp://{_endpoint_host(own_ip)}")
        endpoint = f"tcp://{_endpoint_host(own_ip)}:{port}"
        log.info("network preflight: %d GPU node(s) dial %s", len(nodes), endpoint)
        remote = ray.remote(probe.probe_launcher)
        reply_timeout = max(1.0, timeout * 0.7)
        # The probe's own wait ends early enough for its TCP check and its answer to arrive
        # before this timeout, however long its Ray worker took to start.
        probe_deadline = time.time() + timeout - min(3.0, timeout * 0.25)
        pending = {
            remote.options(num_cpus=0, resources={f"node:{node.ip}": 0.001}, max_retries=0).remote(
                own_ip, port, token, reply_timeout, probe_deadline
            ): node
            for node in nodes
        }
        failures: dict[GpuNode, str] = {}
        heard: set[str] = set()
        deadline = clock() + timeout
        while pending and clock() < deadline and not cancelled():
            _answer_hellos(router, token.encode(), heard, wait_ms=50)
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0.05)
            for ref in done:
                node = pending.pop(ref)
                try:
                    result = ray.get(ref)
                except Exception as exc:  # reported per node below
                    failures[node] = f"the probe task failed: {exc}"
                    continue
                if not result["ok"]:
                    failures[node] = str(result["detail"])
        if cancelled():
            for ref in pending:
                ray.cancel(ref, force=True)
            return
        for ref, node in pending.items():
            said_hello = node.node_id in heard
            failures[node] = f"the probe task did not finish within {timeout:g}s" + (
                " (its hello did arrive)" if said_hello else " (no hello arrived from it)"
            )
            ray.cancel(ref, force=True)
    finally:
        router.close()
        ctx.term()
    if failures:
        listing = "; ".join(f"{node.describe(own_ip)}: {why}" for node, why in failures.items())
        raise PreflightError(
            f"network preflight failed: {len(failures)} of {len(nodes)} GPU node(s) could not "
            f"reach {endpoint} on the launcher's node within {timeout:g}s. vLLM's engines "
            "connect to ZMQ sockets there and would hang; pods must allow all TCP between "
            f"each other. {listing}"
        )
    log.info("network preflight passed: %d GPU node(s) reached %s", len(nodes), endpoint)
