"""A Ray pod's preStop hook: the head drains before its pod stops (a node drain's eviction).

When a pod of a serving replica is deleted by anyone but the operator (`kubectl drain`
evicts it, a node is taken down), its containers would get SIGTERM at once: the head's vLLM
stops while kube-proxy still sends it new connections for a moment, and clients' kept-alive
connections are cut. The operator unroutes the replica as soon as it sees the pod going;
this hook holds the stop meanwhile. It calls the head's drain gate (drain_gate.py), so every
answer from then on closes its connection, and returns once no client request came for
QUIET_SECONDS (the last one answered), or after --max-seconds. A head pod calls its own gate;
a worker pod calls its head's (KubeRay gives workers the head's address as FQ_RAY_IP), since
the replica's engines span its pods.

Nothing serving (the gate does not answer): it returns at once, so a pod the operator deletes
after its own drain, or one that never served, stops without delay. A gate that refuses the
call (an earlier launcher's, no token): it waits GRACE_SECONDS, the endpoint's removal.

    python -m vllm_dp_launcher.prestop --port 8000 [--worker] [--max-seconds 20]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import time
from collections.abc import Callable

from vllm_dp_launcher import drain_gate

#: No client request for this long: the clients have moved to other replicas.
QUIET_SECONDS = 3.0
#: Where the gate cannot say: long enough for the endpoint's removal to reach kube-proxy.
GRACE_SECONDS = 5.0
POLL_SECONDS = 0.5


def idle_seconds(host: str, port: int, token: str, timeout: float = 2.0) -> float | None:
    """The head's time since its last client request, by its drain call; None where the gate
    refused the call or answered no number. Raises OSError when nothing answers."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        headers = {"x-ray-authorization": f"Bearer {token}"} if token else {}
        conn.request("POST", drain_gate.PATH, headers=headers)
        answer = conn.getresponse()
        body = answer.read()
    finally:
        conn.close()
    if answer.status != 200:
        return None
    try:
        return float(json.loads(body)["idleSeconds"])
    except (ValueError, KeyError, TypeError):
        return None


def wait_quiet(host: str, port: int, token: str, max_seconds: float,
               monotonic: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> str:  # fmt: skip
    """Drain the head and wait until it is quiet; what ended the wait, said in a word."""
    deadline = monotonic() + max_seconds
    while True:
        try:
            idle = idle_seconds(host, port, token)
        except OSError:
            return "nothing-serving"
        if idle is None:
            sleep(max(0.0, min(GRACE_SECONDS, deadline - monotonic())))
            return "no-gate"
        if idle >= QUIET_SECONDS:
            return "quiet"
        if monotonic() >= deadline:
            return "deadline"
        sleep(POLL_SECONDS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="the head's API port")
    parser.add_argument("--worker", action="store_true",
                        help="a worker pod: drain the head at FQ_RAY_IP")
    parser.add_argument("--max-seconds", type=float, default=20.0)
    args = parser.parse_args(argv)
    host = os.environ.get("FQ_RAY_IP", "") if args.worker else "127.0.0.1"
    if not host:
        return 0
    wait_quiet(host, args.port, os.environ.get("RAY_AUTH_TOKEN", ""), args.max_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
