"""R3: 1,000 seeded, generated manifests judged by the real API server and by Python `validate`.

Both must accept and reject exactly the same manifests; every rejection names a field; Python
raises nothing but SpecError; for every accepted one, build_plan and the renderers succeed and
the rendered RayCluster, RayJob, Service, EndpointSlice and NetworkPolicy pass the API server's
server-side dry run (KubeRay's CRD schemas, Service validation, names and label values).
"""

from __future__ import annotations

import json
import re
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, seed, settings
from rawapi import RawApi
from specgen import MANIFESTS
from vllm_dp_operator import constants
from vllm_dp_operator.api.validation import SpecError, validate
from vllm_dp_operator.config import RenderOptions
from vllm_dp_operator.render.manifests import API_VERSION, render_all
from vllm_dp_operator.render.meta import owner_reference

pytestmark = pytest.mark.reliability

SPECS = 1000
SEED = 13
THREADS = 4
COLLECTIONS = {
    "RayCluster": "/apis/ray.io/v1/namespaces/{ns}/rayclusters",
    "RayJob": "/apis/ray.io/v1/namespaces/{ns}/rayjobs",
    "Service": "/api/v1/namespaces/{ns}/services",
    "EndpointSlice": "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
    "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
}
FIELD = re.compile(r"\b(spec|metadata)(\.[A-Za-z]|\[)")


def generated() -> list[tuple[str, dict[str, Any]]]:
    """The same SPECS manifests on every run (fixed seed, no example database)."""
    out: list[tuple[str, dict[str, Any]]] = []

    @seed(SEED)
    @settings(max_examples=SPECS, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(MANIFESTS)
    def collect(manifest: tuple[str, dict[str, Any]]) -> None:
        out.append(manifest)

    collect()
    return out


@dataclass
class Verdict:
    """What each side said about one manifest."""

    name: str
    spec: dict[str, Any]
    python_ok: bool = False
    python_fields: list[str] = field(default_factory=list)
    python_crash: str = ""
    api_status: int = 0
    api_message: str = ""
    api_fields: list[str] = field(default_factory=list)
    children: dict[str, tuple[int, str]] = field(default_factory=dict)
    render_crash: str = ""

    @property
    def api_ok(self) -> bool:
        return self.api_status == 201

    def show(self) -> str:
        return (f"name={self.name!r} spec={json.dumps(self.spec)}\n  python: ok={self.python_ok}"
                f" {self.python_fields} {self.python_crash}\n  api: {self.api_status} "
                f"{self.api_message[:600]}")  # fmt: skip


def _python(v: Verdict) -> None:
    try:
        validate(v.name, v.spec)
        v.python_ok = True
    except SpecError as err:
        v.python_fields = [e.path for e in err.errors]
    except Exception as exc:  # the finding: anything but SpecError
        v.python_crash = f"{type(exc).__name__}: {exc}"


def _api(api: RawApi, ns: str, v: Verdict) -> None:
    doc = {"apiVersion": API_VERSION, "kind": constants.KIND,
           "metadata": {"name": v.name, "namespace": ns}, "spec": v.spec}  # fmt: skip
    path = f"/apis/{constants.GROUP}/{constants.VERSION}/namespaces/{ns}/{constants.PLURAL}"
    v.api_status, body = api.dry_run_create(path, doc)
    if not v.api_ok:
        v.api_message = str((body or {}).get("message"))
        causes = ((body or {}).get("details") or {}).get("causes") or []
        v.api_fields = [str(c.get("field")) for c in causes if c.get("field")]


def _children(api: RawApi, ns: str, v: Verdict) -> None:
    doc = {"apiVersion": API_VERSION, "kind": constants.KIND,
           "metadata": {"name": v.name, "namespace": ns}, "spec": v.spec}  # fmt: skip
    try:
        owner = owner_reference(v.name, str(uuid.UUID(int=1)))
        children = render_all(doc, RenderOptions(), owner)
    except Exception as exc:
        v.render_crash = f"{type(exc).__name__}: {exc}"
        return
    for child in children:
        status, body = api.dry_run_create(COLLECTIONS[child["kind"]].format(ns=ns), child)
        v.children[child["kind"]] = (status, "" if status == 201 else str(body)[:600])


def test_fuzzed_specs_same_verdict_in_python_and_the_api_server(
    testbed: Any, testbed_namespace: str
) -> None:
    ns = testbed_namespace
    import operator_proc

    operator_proc.install_crd(testbed)
    api = RawApi(testbed.server, testbed.admin_token, testbed.state_dir / "pki" / "ca.crt")
    verdicts = [Verdict(name, spec) for name, spec in generated()]
    assert len(verdicts) == SPECS

    def judge(v: Verdict) -> None:
        _python(v)
        _api(api, ns, v)
        if v.api_ok and v.python_ok:
            _children(api, ns, v)

    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(judge, verdicts))

    crashes = [v for v in verdicts if v.python_crash]
    disagree = [v for v in verdicts if not v.python_crash and v.python_ok != v.api_ok]
    unnamed = [v for v in verdicts if not v.python_ok and not v.python_crash and (
        not v.python_fields or not all(FIELD.match(f) for f in v.python_fields))]
    api_unnamed = [v for v in verdicts if not v.api_ok and not (
        v.api_fields or FIELD.search(v.api_message))]
    render_crashes = [v for v in verdicts if v.render_crash]
    child_rejects = [v for v in verdicts if any(s != 201 for s, _ in v.children.values())]
    accepted = sum(v.api_ok for v in verdicts)
    sys.stderr.write(
        f"\n[R3] specs fuzzed: {len(verdicts)} (seed {SEED}); accepted by both: "
        f"{sum(v.api_ok and v.python_ok for v in verdicts)}; rejected by both: "
        f"{sum(not v.api_ok and not v.python_ok for v in verdicts)}; disagreements: "
        f"{len(disagree)}; Python crashes: {len(crashes)}; render crashes: "
        f"{len(render_crashes)}; children dry-run: {sum(len(v.children) for v in verdicts)} "
        f"sent, {len(child_rejects)} specs with a rejected child\n"
    )
    problems = [
        ("Python raised something other than SpecError", crashes),
        ("Python and the API server disagree", disagree),
        ("a Python rejection names no field", unnamed),
        ("an API rejection names no field", api_unnamed),
        ("the renderers failed on an accepted spec", render_crashes),
        ("the API server rejected a rendered child", child_rejects),
    ]
    report = "\n".join(
        f"{what}: {len(found)}\n" + "\n".join(
            v.show() + (f"\n  render: {v.render_crash}" if v.render_crash else "")
            + "".join(f"\n  {k}: {s} {m}" for k, (s, m) in v.children.items() if s != 201)
            for v in found[:5])
        for what, found in problems if found
    )  # fmt: skip
    assert not report, report
    assert accepted >= SPECS // 5, f"only {accepted} accepted: the generator is too hostile"
