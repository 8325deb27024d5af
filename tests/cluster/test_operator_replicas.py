"""Replicas on real nodes (issue 37) on the engine double, measured from the client's side.

One resource on the engine double (DP=2 in one Ray pod per replica), shared by the scenarios
of replicasteps.py in file order: scaled to two replicas with `kubectl scale`, one replica's
head pod deleted under load, one replica's node drained under load, a rolling engine change
with `maxSurge: 0`, then scaled back to one under load. Real vLLM runs the same procedures
(test_operator_vllm_cpu.py, opt-in).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from . import replicasteps as steps
from .bed import RunningCluster
from .traffic import Traffic
from .vdp import API_PORT, Vdp, http, import_engine, own_namespace
from .vdp import report as print_report

pytestmark = pytest.mark.cluster

IMAGE = "vllm-dp-engine-double"
NAME = "reps"
MODEL = "double"
NS = "t-replicas"
#: The rolling scenario's engine change: an engine argument the double records (its argv).
CHANGED_ARG = "--max-model-len=4096"


def resource(ns: str, **spec_fields: Any) -> dict[str, Any]:
    spec = {"model": "cluster/double-model", "servedModelName": MODEL, "image": f"{IMAGE}:dev",
            "dataParallel": {"size": 2, "ranksPerNode": 2}, "apiServerCount": 1,
            "resources": {"memory": "1Gi"}, "shmSize": "64Mi",
            "env": [{"name": "VLLMDP_DOUBLE_PLACE", "value": "1"}],
            "launch": {"timeoutSeconds": 300, "drainSeconds": 3},
            "update": {"strategy": "RollingUpdate", "drainSeconds": 10}, **spec_fields}  # fmt: skip
    return {"apiVersion": "vllmdp.io/v1alpha1", "kind": "VLLMDataParallel",
            "metadata": {"name": NAME, "namespace": ns}, "spec": spec}


def changed() -> dict[str, Any]:
    return resource(NS, replicas=2, engineArgs=[CHANGED_ARG],
                    update={"strategy": "RollingUpdate", "maxSurge": 0, "maxUnavailable": 1,
                            "drainSeconds": 10})  # fmt: skip


def runs_changed(ip: str) -> bool:
    argv = http(f"http://{ip}:{API_PORT}/double/argv")["argv"]
    return any(CHANGED_ARG in (a, f"{a}={b}") for a, b in zip(argv, [*argv[1:], ""], strict=True))


@pytest.fixture(scope="module")
def scene(operator: RunningCluster, request: pytest.FixtureRequest) -> Iterator[steps.Scene]:
    own_namespace(operator, NS)
    import_engine(operator, IMAGE)
    operator.apply(resource(NS))
    vdp = Vdp(operator, NS, NAME)
    vdp.wait_phase("Serving", 300)
    url = f"http://{vdp.service_ip()}:{API_PORT}"

    def clients(scenario: str) -> tuple[Traffic, Traffic]:
        return (Traffic(operator, NS, url, MODEL, f"{IMAGE}:dev", name=f"new-{scenario}"),
                Traffic(operator, NS, url, MODEL, f"{IMAGE}:dev", name=f"kept-{scenario}",
                        keep_alive=True))  # fmt: skip

    def answer(ip: str) -> str:
        return str(http(f"http://{ip}:{API_PORT}/v1/completions",
                        {"model": MODEL, "prompt": "hi", "max_tokens": 1})["object"])  # fmt: skip

    lines: dict[str, str] = {}
    yield steps.Scene(vdp, clients, answer, changed, runs_changed, lines)
    print_report(request, "availability", lines)
    operator.kubectl("delete", "namespace", NS, "--wait=false", check=False)


@pytest.mark.parametrize("scenario", steps.SCENARIOS, ids=lambda f: f.__name__)
def test_replicas_on_the_engine_double(
    scene: steps.Scene, scenario: Callable[[steps.Scene], None]
) -> None:
    scenario(scene)
