"""Tell a head that leaves its Service to close each kept-alive connection after its next
answer, and learn how long no client request came there.

The launcher's gate in front of vLLM (vllm_dp_launcher/drain_gate.py) answers
`POST /vllmdp/drain`: from then on its answers carry `Connection: close`, so the clients whose
kept connections stay on the old head (kube-proxy keeps established flows on a removed
endpoint) move to the Service's other endpoints one answer later, told by the server, instead
of being cut when its engines stop. The call carries the Ray cluster's token where there is
one. A head without the gate (launched by an earlier release) answers 404: its drain ends as
before, on its running requests alone.
"""

from __future__ import annotations

import json

from vllm_dp_launcher import drain_gate

from vllm_dp_operator import constants
from vllm_dp_operator.engines.transport import ServiceTransport

#: The drain call's answer is one small JSON object.
ANSWER_MAX_BYTES = 4 * 1024


async def mark_draining(transport: ServiceTransport, namespace: str, service: str, port: int,
                        token: str | None) -> float | None:  # fmt: skip
    """Start (or go on with) the head's drain; the seconds since its last client request, or
    None when it cannot say (no gate there, or no answer)."""
    headers = {constants.RAY_AUTH_HEADER: f"Bearer {token}"} if token else None
    answer = await transport.request("POST", namespace, service, port, drain_gate.PATH,
                                     limit=ANSWER_MAX_BYTES, headers=headers)  # fmt: skip
    if answer.status != 200:
        return None
    try:
        return float(json.loads(answer.body)["idleSeconds"])
    except (ValueError, KeyError, TypeError):
        return None
