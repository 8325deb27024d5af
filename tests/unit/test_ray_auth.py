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
import re
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
from vllm_dp_operator.engines.ray_auth import RayTokens, key_id
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
UID = "uid-1"
TOKEN = RayTokens(KEY).token("ns1", "demo", UID)


def test_the_token_is_a_function_of_the_key_namespace_name_and_uid() -> None:
    tokens = RayTokens(KEY)
    assert tokens.token("ns1", "demo", UID) == TOKEN == RayTokens(KEY).token("ns1", "demo", UID)
    others = {tokens.token("ns2", "demo", UID), tokens.token("ns1", "demo2", UID),
              RayTokens(b"x" * 32).token("ns1", "demo", UID), tokens.token("ns1d", "emo", UID),
              tokens.token("ns1", "demo", "uid-2"), tokens.legacy_token("ns1", "demo")}  # fmt: skip
    assert TOKEN not in others and len(others) == 6
    assert len(TOKEN) == 43 and TOKEN.replace("-", "").replace("_", "").isalnum()


def test_the_secret_name_says_the_key_id_and_a_tag_only_the_key_derives() -> None:
    tokens, other = RayTokens(KEY), RayTokens(b"x" * 32)
    name = tokens.secret_name("ns1", "demo", UID)
    assert re.fullmatch(rf"demo-ray-token-{tokens.key_id}[0-9a-f]{{8}}", name), name
    assert tokens.key_id == key_id(KEY) != other.key_id and len(tokens.key_id) == 8
    # Another uid (a namesake made again), another namespace or another key: another name.
    assert len({name, tokens.secret_name("ns1", "demo", "uid-2"),
                tokens.secret_name("ns2", "demo", UID), other.secret_name("ns1", "demo", UID)}) == 4
    # A cluster's Secret gives back its token; a name the key did not make gives none.
    assert tokens.of_secret("ns1", "demo", UID, name) == TOKEN
    assert tokens.of_secret("ns1", "demo", "uid-2", name) is None  # an earlier uid's
    assert tokens.of_secret("ns1", "demo", UID, f"demo-ray-token-{tokens.key_id}00000000") is None
    assert other.of_secret("ns1", "demo", UID, name) is None
    assert tokens.of_secret("ns1", "demo", UID, "other-ray-token") is None


def test_a_cluster_of_the_first_scheme_keeps_its_namespace_and_name_token() -> None:
    # Clusters an earlier release made name `<name>-ray-token` and hold an HMAC of the
    # namespace and name: the operator goes on calling them after an upgrade.
    tokens = RayTokens(KEY)
    legacy = {"spec": {"authOptions": {"mode": "token", "secretName": "demo-ray-token"}}}
    assert tokens.of_cluster("ns1", "demo", UID, legacy) == tokens.legacy_token("ns1", "demo")
    assert tokens.legacy_token("ns1", "demo") == _first_scheme(KEY, "ns1", "demo")
    assert tokens.of_cluster("ns1", "demo", UID, {"spec": {}}) is None  # no token auth
    assert tokens.of_cluster("ns1", "demo", UID, None) is None


def test_a_rotation_calls_clusters_of_the_previous_key_and_makes_new_ones_of_the_new() -> None:
    old, new = b"o" * 32, b"n" * 32
    before = RayTokens(old)
    old_cluster = {"spec": {"authOptions": {
        "mode": "token", "secretName": before.secret_name("ns1", "demo", UID)}}}  # fmt: skip
    legacy = {"spec": {"authOptions": {"mode": "token", "secretName": "demo-ray-token"}}}
    during = RayTokens(new, previous=old)
    assert during.key_id == key_id(new)
    assert during.secret_name("ns1", "demo", UID).startswith(f"demo-ray-token-{key_id(new)}")
    # The old clusters still answer the operator until a restart replaces them...
    assert during.of_cluster("ns1", "demo", UID, old_cluster) == before.token("ns1", "demo", UID)
    assert during.of_cluster("ns1", "demo", UID, legacy) == before.legacy_token("ns1", "demo")
    # ...and once the previous key is gone, their tokens are no token of the operator's.
    after = RayTokens(new)
    assert after.of_cluster("ns1", "demo", UID, old_cluster) is None
    assert during.token("ns1", "demo", UID) == after.token("ns1", "demo", UID) != before.token(
        "ns1", "demo", UID)


def _first_scheme(key: bytes, namespace: str, name: str) -> str:
    """The token an earlier release derived, written out here independently."""
    import hashlib
    import hmac

    mac = hmac.new(key, b"vllmdp.io ray auth token v1\0" + f"{namespace}\0{name}".encode(),
                   hashlib.sha256)  # fmt: skip
    return base64.urlsafe_b64encode(mac.digest()).decode().rstrip("=")


def test_the_key_file_is_read_and_a_short_key_refused(tmp_path: Path) -> None:
    (tmp_path / "key").write_bytes(KEY + b"\n")
    assert RayTokens.from_file(str(tmp_path / "key")).token("ns1", "demo", UID) == TOKEN
    (tmp_path / "short").write_bytes(b"k" * 31)
    with pytest.raises(ValueError, match=r"VLLMDP_RAY_AUTH_KEY_FILE=.*at least 32 bytes"):
        RayTokens.from_file(str(tmp_path / "short"))
    # The previous key's file is read where it exists (a rotation), and checked the same way.
    (tmp_path / "previous").write_bytes(b"p" * 32)
    both = RayTokens.from_file(str(tmp_path / "key"), str(tmp_path / "previous"))
    assert both.legacy_token("ns1", "demo") == RayTokens(b"p" * 32).legacy_token("ns1", "demo")
    lone = RayTokens.from_file(str(tmp_path / "key"), str(tmp_path / "absent"))
    assert lone.legacy_token("ns1", "demo") == RayTokens(KEY).legacy_token("ns1", "demo")
    with pytest.raises(ValueError, match=r"VLLMDP_RAY_AUTH_PREVIOUS_KEY_FILE=.*at least 32"):
        RayTokens.from_file(str(tmp_path / "key"), str(tmp_path / "short"))


def test_no_key_file_means_a_random_key_and_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    a, b = RayTokens.from_file(""), RayTokens.from_file("")
    assert a.token("ns1", "demo", UID) != b.token("ns1", "demo", UID)
    assert "VLLMDP_RAY_AUTH_KEY_FILE is unset" in caplog.text
    assert repr(a).startswith("<vllm_dp_operator.engines.ray_auth.RayTokens object")  # no key


def _cluster(raw: dict[str, Any]) -> dict[str, Any]:
    s = validate("demo", raw)
    return build_raycluster("demo", "ns1", s, build_plan(s), RenderOptions(), None)


def test_token_auth_is_on_by_default_with_the_operators_secret() -> None:
    body = _cluster(spec())["spec"]
    # Rendered without the operator's key (the CLI's offline render): the first scheme's name.
    assert body["authOptions"] == {"mode": "token", "secretName": "demo-ray-token"}
    s = validate("demo", spec())
    named = build_raycluster("demo", "ns1", s, build_plan(s), RenderOptions(), None,
                             token_secret="demo-ray-token-0123456789abcdef")  # fmt: skip
    assert named["spec"]["authOptions"]["secretName"] == "demo-ray-token-0123456789abcdef"
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
    secret = build_ray_token_secret("demo", "ns1", "demo-ray-token-x", TOKEN, owner)
    assert secret["metadata"]["name"] == "demo-ray-token-x"
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
    name = CFG.ray_tokens.secret_name("default", "demo", w.uid)
    assert secret["metadata"]["name"] == name
    assert w.clusters()[0]["spec"]["authOptions"]["secretName"] == name
    token = CFG.ray_tokens.token("default", "demo", w.uid)
    assert base64.b64decode(secret["data"]["auth_token"]).decode() == token
    assert secret["metadata"]["ownerReferences"][0]["uid"] == w.uid
    order = [(kind, name) for verb, kind, name in w.kube.writes if verb == "create"]
    assert order.index(("secrets", name)) < order.index(
        ("rayclusters", w.clusters()[0]["metadata"]["name"]))
    await w.step()
    w.cluster_ready()
    await w.step()
    creates = [n for verb, kind, n in w.kube.writes if kind == "secrets"]
    assert creates == [name], "created once, with the cluster"
    assert "secrets" not in read and {"services", "rayclusters"} <= set(read)


async def test_a_secret_deleted_under_its_cluster_is_made_again() -> None:
    # Someone deleted it; the Ray pods wait for it (CreateContainerConfigError), which wakes
    # the reconcile.
    w = World(spec())
    await w.step()
    name = CFG.ray_tokens.secret_name("default", "demo", w.uid)
    del w.kube.objects[(SECRET, "default", name)]
    cluster = w.clusters()[0]["metadata"]["name"]
    w.new_head_pod(cluster)
    pod = w.head_pod(cluster)
    assert pod is not None
    pod["status"] = {"phase": "Pending", "containerStatuses": [{"name": "ray-head", "state": {
        "waiting": {"reason": "CreateContainerConfigError",
                    "message": f'secret "{name}" not found'}}}]}  # fmt: skip
    await w.step()
    assert [o["metadata"]["name"] for o in w.kube.named(SECRET)] == [name]


async def test_a_secret_planted_under_the_earlier_name_is_never_mounted() -> None:
    # A namespace member with create on Secrets plants `<name>-ray-token` (the name an earlier
    # release used) before the resource exists, with a token of their own.
    w = World(spec())
    planted = {"apiVersion": "v1", "kind": "Secret", "metadata": {
        "name": "demo-ray-token", "namespace": "default"},
        "data": {"auth_token": base64.b64encode(b"known").decode()}}  # fmt: skip
    w.kube.objects[(SECRET, "default", "demo-ray-token")] = planted
    await w.step()
    (cluster,) = w.clusters()
    assert cluster["spec"]["authOptions"]["secretName"] == CFG.ray_tokens.secret_name(
        "default", "demo", w.uid) != "demo-ray-token"
    assert w.kube.objects[(SECRET, "default", "demo-ray-token")] is planted  # untouched


async def test_a_cluster_an_earlier_release_made_is_called_with_its_own_token() -> None:
    # Upgraded from a release whose clusters name `<name>-ray-token`: the cluster stays, and
    # the operator's calls carry the token of the scheme it was made with.
    w = await serving(spec(launch={"drainSeconds": 0}))
    (cluster,) = w.clusters()
    cluster["spec"]["authOptions"]["secretName"] = "demo-ray-token"
    s = validate("demo", spec(launch={"drainSeconds": 0}))
    cluster["metadata"]["labels"][c.LABEL_CLUSTER_HASH] = cluster_hash(
        "demo", s, build_plan(s), CFG.render)  # its shape as that release rendered it
    legacy = CFG.ray_tokens.legacy_token("default", "demo")
    w.ray.replaced_token = legacy  # what its pods hold
    for _ in range(3):
        await w.step(5)
    assert [cl["metadata"]["uid"] for cl in w.clusters()] == [cluster["metadata"]["uid"]]
    assert w.status["phase"] == c.PHASE_SERVING
    w.update(spec(engineArgs=["--enforce-eager"], launch={"drainSeconds": 0}))
    await w.step()
    assert w.ray.stops == ["demo-j00001"] and set(w.ray.tokens) == {legacy}


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
    assert set(w.ray.tokens) == {CFG.ray_tokens.token("default", "demo", w.uid)}


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
    assert Config.from_env().ray_tokens.token("ns1", "demo", UID) == TOKEN
