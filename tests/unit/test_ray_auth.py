"""Ray token authentication: on by default, the operator's token Secret, and its derived token.

KubeRay facts these tests pin (ray-operator v1.6.2): with `authOptions.secretName` set KubeRay
makes no Secret of its own and reads the token from the key `auth_token`
(raycluster_controller.go reconcileAuthSecret; utils/constant.go RAY_AUTH_TOKEN_SECRET_KEY),
and its dashboard client sends `x-ray-authorization: Bearer <token>`
(dashboardclient/dashboard_httpclient.go). Ray 2.60's dashboard answers 401 without a token
and 403 with a wrong one (ray/_private/authentication/http_token_authentication.py).
"""

from __future__ import annotations

import base64
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from kubernetes_asyncio import client
from vllm_dp_operator import constants as c
from vllm_dp_operator.api.validation import SpecError, validate
from vllm_dp_operator.config import Config, RenderOptions
from vllm_dp_operator.controller.kube import SECRET
from vllm_dp_operator.engines.ray_auth import RayTokens
from vllm_dp_operator.engines.ray_dashboard import UNKNOWN, DashboardJobs
from vllm_dp_operator.engines.transport import ApiServerProxyTransport, ServiceDnsTransport
from vllm_dp_operator.plan import build_plan
from vllm_dp_operator.render import build_raycluster, cluster_hash
from vllm_dp_operator.render.meta import owner_reference
from vllm_dp_operator.render.raytoken import build_ray_token_secret

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "doubles"))
from loopback_dns import LoopbackDns
from world import CFG, World, serving, spec

KEY = b"k" * 32
TOKEN = RayTokens(KEY).token("ns1", "demo")


def test_the_token_is_a_function_of_the_key_namespace_and_name() -> None:
    tokens = RayTokens(KEY)
    assert tokens.token("ns1", "demo") == TOKEN == RayTokens(KEY).token("ns1", "demo")
    others = {tokens.token("ns2", "demo"), tokens.token("ns1", "demo2"),
              RayTokens(b"x" * 32).token("ns1", "demo"), tokens.token("ns1d", "emo")}  # fmt: skip
    assert TOKEN not in others and len(others) == 4
    assert len(TOKEN) == 43 and TOKEN.replace("-", "").replace("_", "").isalnum()


def test_the_key_file_is_read_and_a_short_key_refused(tmp_path: Path) -> None:
    (tmp_path / "key").write_bytes(KEY + b"\n")
    assert RayTokens.from_file(str(tmp_path / "key")).token("ns1", "demo") == TOKEN
    (tmp_path / "short").write_bytes(b"k" * 31)
    with pytest.raises(ValueError, match=r"VLLMDP_RAY_AUTH_KEY_FILE=.*at least 32 bytes"):
        RayTokens.from_file(str(tmp_path / "short"))


def test_no_key_file_means_a_random_key_and_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    a, b = RayTokens.from_file(""), RayTokens.from_file("")
    assert a.token("ns1", "demo") != b.token("ns1", "demo")
    assert "VLLMDP_RAY_AUTH_KEY_FILE is unset" in caplog.text
    assert repr(a).startswith("<vllm_dp_operator.engines.ray_auth.RayTokens object")  # no key


def _cluster(raw: dict[str, Any]) -> dict[str, Any]:
    s = validate("demo", raw)
    return build_raycluster("demo", "ns1", s, build_plan(s), RenderOptions(), None)


def test_token_auth_is_on_by_default_with_the_operators_secret() -> None:
    body = _cluster(spec())["spec"]
    assert body["authOptions"] == {"mode": "token", "secretName": "demo-ray-token"}
    assert body["rayVersion"] >= "2.52.0"  # KubeRay refuses token mode below Ray 2.52


def test_disabled_renders_no_auth_options_and_is_another_shape() -> None:
    off = spec(ray={"auth": "disabled"})
    assert "authOptions" not in _cluster(off)["spec"]
    s_on, s_off = validate("demo", spec()), validate("demo", off)
    assert cluster_hash("demo", s_on, build_plan(s_on), RenderOptions()) != cluster_hash(
        "demo", s_off, build_plan(s_off), RenderOptions())


def test_an_unknown_auth_mode_is_refused_naming_the_field() -> None:
    with pytest.raises(SpecError, match=r"ray\.auth"):
        validate("demo", spec(ray={"auth": "k8s"}))


def test_the_token_secret_has_kuberays_key_and_the_owner() -> None:
    owner = owner_reference("demo", "uid-1")
    secret = build_ray_token_secret("demo", "ns1", TOKEN, owner)
    assert secret["metadata"]["name"] == "demo-ray-token"
    assert secret["metadata"]["ownerReferences"] == [owner]
    assert secret["metadata"]["labels"][c.LABEL_COMPONENT] == "ray-auth"
    assert base64.b64decode(secret["data"]["auth_token"]).decode() == TOKEN
    assert set(secret["data"]) == {"auth_token"} and secret["type"] == "Opaque"


async def test_the_secret_is_created_before_the_cluster_and_never_read() -> None:
    w = World(spec())
    read: list[str] = []
    get, list_ = w.kube.get, w.kube.list

    async def recording_get(kind: Any, *args: Any) -> Any:
        read.append(kind.plural)
        return await get(kind, *args)

    async def recording_list(kind: Any, *args: Any) -> Any:
        read.append(kind.plural)
        return await list_(kind, *args)

    w.kube.get, w.kube.list = recording_get, recording_list  # type: ignore[method-assign]
    await w.step()
    (secret,) = w.kube.named(SECRET)
    token = CFG.ray_tokens.token("default", "demo")
    assert base64.b64decode(secret["data"]["auth_token"]).decode() == token
    assert secret["metadata"]["ownerReferences"][0]["uid"] == w.uid
    order = [(kind, name) for verb, kind, name in w.kube.writes if verb == "create"]
    assert order.index(("secrets", "demo-ray-token")) < order.index(
        ("rayclusters", w.clusters()[0]["metadata"]["name"]))
    await w.step()
    w.cluster_ready()
    await w.step()
    creates = [n for verb, kind, n in w.kube.writes if kind == "secrets"]
    assert creates == ["demo-ray-token"], "created once, with the cluster"
    assert "secrets" not in read and {"services", "rayclusters"} <= set(read)


async def test_a_secret_the_garbage_collector_took_is_made_again() -> None:
    # A namesake's Secret was there at the first create (409), then went with its owner; the
    # Ray pods wait for it (CreateContainerConfigError), which wakes the reconcile.
    w = World(spec())
    await w.step()
    del w.kube.objects[(SECRET, "default", "demo-ray-token")]
    cluster = w.clusters()[0]["metadata"]["name"]
    w.new_head_pod(cluster)
    pod = w.head_pod(cluster)
    assert pod is not None
    pod["status"] = {"phase": "Pending", "containerStatuses": [{"name": "ray-head", "state": {
        "waiting": {"reason": "CreateContainerConfigError",
                    "message": 'secret "demo-ray-token" not found'}}}]}  # fmt: skip
    await w.step()
    assert [o["metadata"]["name"] for o in w.kube.named(SECRET)] == ["demo-ray-token"]


async def test_disabled_creates_no_secret_and_calls_the_dashboard_without_a_token() -> None:
    raw = spec(ray={"auth": "disabled"}, launch={"drainSeconds": 0})
    w = await serving(raw)
    assert w.kube.named(SECRET) == []
    w.update({**raw, "engineArgs": ["--enforce-eager"]})
    await w.step()
    assert w.ray.stops == ["demo-j00001"] and set(w.ray.tokens) == {None}


async def test_the_operators_dashboard_calls_carry_the_clusters_token() -> None:
    # The double answers like Ray with token auth (world.py): without the token, no stop.
    w = await serving(spec(launch={"drainSeconds": 0}))
    w.update(spec(engineArgs=["--enforce-eager"], launch={"drainSeconds": 0}))
    await w.step()
    assert w.ray.stops == ["demo-j00001"]
    assert set(w.ray.tokens) == {CFG.ray_tokens.token("default", "demo")}


async def test_a_token_the_dashboard_refuses_is_no_delivered_stop() -> None:
    # The pods hold another token (their Secret was replaced, or the operator's key changed).
    w = await serving(spec(launch={"drainSeconds": 0}))
    w.ray.replaced_token = "another"
    w.update(spec(engineArgs=["--enforce-eager"], launch={"drainSeconds": 0}))
    await w.step()
    assert w.ray.stops == [] and w.job_names() == ["demo-j00001"]
    assert "HTTP 403" in w.status["message"]


# --- The header on the wire, through both transports --------------------------------------

JOB = "/api/jobs/demo-j00001"
PROXY_JOB = f"/api/v1/namespaces/ns1/services/demo-abcde-head-svc:8265/proxy{JOB}"


@pytest.fixture
async def ray_head() -> AsyncIterator[dict[str, Any]]:
    """Test double for Ray's dashboard with RAY_AUTH_MODE=token (its middleware's answers),
    on the plain path and on the API server's proxy path."""
    seen: dict[str, Any] = {"auth": []}

    async def handle(request: web.Request) -> web.Response:
        seen["auth"].append((request.headers.get("Authorization"),
                             request.headers.get(c.RAY_AUTH_HEADER)))  # fmt: skip
        header = request.headers.get(c.RAY_AUTH_HEADER, "")
        if not header:
            return web.Response(status=401, text="Unauthorized: Missing authentication token")
        if header != f"Bearer {TOKEN}":
            return web.Response(status=403, text="Forbidden: Invalid authentication token")
        if request.method == "POST":
            return web.json_response({"stopped": True})
        return web.json_response({"submission_id": "demo-j00001", "status": "RUNNING"})

    app = web.Application()
    for path in (JOB, f"{JOB}/stop", PROXY_JOB, f"{PROXY_JOB}/stop"):
        app.router.add_route("*", path, handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    seen["port"] = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield seen
    await runner.cleanup()


async def test_through_the_api_server_proxy_the_token_rides_beside_the_operators_own(
    ray_head: dict[str, Any]
) -> None:
    conf = client.Configuration(host=f"http://127.0.0.1:{ray_head['port']}")
    conf.api_key = {"BearerToken": "operator-sa-token"}
    conf.api_key_prefix = {"BearerToken": "Bearer"}
    async with client.ApiClient(configuration=conf) as api:
        jobs = DashboardJobs(ApiServerProxyTransport(api, 2))
        refused = await jobs.lookup("ns1", "demo-abcde", "demo-j00001", None)
        wrong = await jobs.stop("ns1", "demo-abcde", "demo-j00001", "nope")
        lookup = await jobs.lookup("ns1", "demo-abcde", "demo-j00001", TOKEN)
        stop = await jobs.stop("ns1", "demo-abcde", "demo-j00001", TOKEN)
    assert refused.state == UNKNOWN and "HTTP 401" in refused.detail
    assert "refused the operator's token" in refused.detail
    assert not wrong.delivered and "HTTP 403" in wrong.detail
    assert lookup.state == "RUNNING" and stop.delivered
    # The API server's credential stays in Authorization, which the API server consumes.
    assert ray_head["auth"][-1] == ("Bearer operator-sa-token", f"Bearer {TOKEN}")
    assert TOKEN not in lookup.detail + stop.detail


async def test_by_cluster_dns_the_token_rides_in_kuberays_header(
    ray_head: dict[str, Any]
) -> None:
    transport = ServiceDnsTransport(2, "cluster.local", resolver=LoopbackDns())
    try:
        # The test double listens on its own port, standing in for the dashboard's 8265.
        answer = await transport.request(
            "GET", "ns1", "demo-abcde-head-svc", ray_head["port"], JOB,
            headers={c.RAY_AUTH_HEADER: f"Bearer {TOKEN}"})  # fmt: skip
        assert answer.ok, answer.detail
        none = await transport.request("GET", "ns1", "demo-abcde-head-svc", ray_head["port"],
                                       JOB)  # fmt: skip
        assert none.status == 401
    finally:
        await transport.close()
    assert ray_head["auth"][0] == (None, f"Bearer {TOKEN}")


def test_config_reads_the_key_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "key").write_bytes(KEY)
    monkeypatch.setenv("VLLMDP_RAY_AUTH_KEY_FILE", str(tmp_path / "key"))
    assert Config.from_env().ray_tokens.token("ns1", "demo") == TOKEN
