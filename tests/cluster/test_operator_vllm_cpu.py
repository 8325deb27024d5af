"""Real vLLM engines at DP=2 on two real nodes, launched by the helm-installed operator from
`examples/dev-cpu-lora.yaml` (`examples/dev-cpu.yaml` with two LoRA adapters) as it is checked
in (issue 10).

vLLM's CPU build in the `vllm-dp-engine-cpu` test image serves the tiny model at
/models/tiny; Ray nodes hold logical GPUs from the nodes' advertised `nvidia.com/gpu`, so the
operator renders the example through the same code as a GPU one, and vLLM's own Ray
data-parallel backend places one engine on each pod.

Observability on real engines (issue 12): a real Prometheus on the host (Debian's package)
scrapes the head pod's vLLM through the chart's own PodMonitor, rendered with the values the
bed installs with and turned into a scrape job over the bed's pods (promlib: Debian's build
has no kubernetes_sd); vLLM's per-rank gauges show requests kept in flight on both ranks,
and status.load moves off Idle.

Secure by default (issue 19), on the same one deployment: the namespace enforces Pod Security
`restricted`, the API key comes from a Secret through `spec.apiKeySecretRef`, and Ray token
authentication is on (the default): the dashboard refuses a request without the token, while
the operator's /health probe, its stop-and-confirm and KubeRay's submission and deletion work.

Changes on the same deployment: D, a Surge of `--max-model-len` under a new-connection and a
kept-alive client (issues 17 and 38); D2, a Surge of `spec.service.port` alone (issue 38, the
procedure of portsurge.py). Opt-in (`make test-autoscaling`, marker `keda`): KEDA scaling the
resource 1 -> 2 -> 1 replicas on vLLM's queue (issue 37). Opt-in (`make test-replicas-vllm`,
marker `replicas_vllm`, four nodes): issue 37's replica scenarios of replicasteps.py at
`replicas: 2` (the engine double runs them in `make test`).
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from . import replicasteps, timeline
from .bed import REPO, RunningCluster, testbed_cli
from .portsurge import NEW_PORT, surge_to_new_port
from .traffic import Traffic
from .vdp import (
    API_PORT,
    OPERATOR_LABEL,
    OPERATOR_NS,
    Vdp,
    http,
    http_status,
    import_engine,
    operator_values,
    own_namespace,
    report,
)

# isort: split
# tests/testbed is on sys.path once .vdp is imported.
import hostnet
import operatorchart
from common import kubectl_table
from promlib import Prometheus, file_sd, pod_targets, scrape_config_from_pod_monitor

pytestmark = pytest.mark.cluster

IMAGE = "vllm-dp-engine-cpu"
#: examples/dev-cpu.yaml with its two LoRA adapters (issue 40): every scenario here runs with
#: them, and a relaunch or a Surge must bring them back before it is routed.
EXAMPLE = REPO / "examples" / "dev-cpu-lora.yaml"
NS = "t-vllm-cpu"
# The API key clients must send: a test value, in a Secret the spec refers to.
API_KEY = "sk-test-" + "5e1f" * 8
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def example(ns: str, max_model_len: int | None = None,
            adapters: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """The checked-in example, plus the API key from the test's Secret; `adapters` (name to
    path) in place of its own."""
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["namespace"] = ns
    if adapters is not None:
        doc["spec"]["lora"]["adapters"] = [{"name": n, "source": {"path": p}}
                                           for n, p in adapters.items()]  # fmt: skip
    doc["spec"]["apiKeySecretRef"] = {"name": "api-key", "key": "key"}
    if max_model_len is not None:
        args = doc["spec"]["engineArgs"]
        args[:] = [f"--max-model-len={max_model_len}" if a.startswith("--max-model-len")
                   else a for a in args]  # fmt: skip
    return doc


def note(msg: str) -> None:
    sys.stderr.write(f"[vllm-cpu] {msg}\n")


@pytest.fixture(scope="module")
def vdp(operator: RunningCluster, request: pytest.FixtureRequest) -> Iterator[Vdp]:
    note(import_engine(operator, IMAGE))
    own_namespace(operator, NS)
    # PodSecurity admission refuses any Ray pod that is not `restricted`, KubeRay's included.
    operator.kubectl("label", "namespace", NS, "pod-security.kubernetes.io/enforce=restricted",
                     "pod-security.kubernetes.io/enforce-version=latest")  # fmt: skip
    operator.kubectl("create", "secret", "generic", "api-key", "-n", NS,
                     f"--from-literal=key={API_KEY}")  # fmt: skip
    doc = example(NS)
    v = Vdp(operator, NS, doc["metadata"]["name"])
    ROUTES.append(timeline.route_watch([str(operator.bin_dir / "kubectl"),
                                        f"--kubeconfig={operator.kubeconfig}"], NS,
                                       f"{v.name}-api"))  # fmt: skip
    t0 = time.monotonic()
    APPLIED.append(time.time())
    operator.apply(doc)
    v.wait("the RayCluster ready", lambda: v.status().get("rayCluster") and (
        operator.kubectl_json("get", "raycluster", v.status()["rayCluster"], "-n", NS)
        .get("status", {}).get("state") == "ready"), 300)  # fmt: skip
    note(f"RayCluster ready {time.monotonic() - t0:.0f}s after apply")
    v.wait_phase("Serving", 600)
    note(f"Serving {time.monotonic() - t0:.0f}s after apply")
    LAUNCHES.append(launch_of(v, "first launch", APPLIED[0], joined=True))
    try:
        yield v
    finally:
        ROUTES[0].stop()
        operator.kubectl("delete", "namespace", NS, "--wait=false", check=False)
        report(request, "availability, real vLLM", FAULTS)
        if LAUNCHES:
            note("launch timeline (issue 22, p5):\n" + timeline.HEADER + "\n"
                 + "\n".join(la.row() for la in LAUNCHES))  # fmt: skip
            note("last join to exec, in steps (s: whole-second witnesses):\n"
                 + timeline.STEPS_HEADER + "\n"
                 + "\n".join(la.steps_row() for la in LAUNCHES))  # fmt: skip
            if FLOORS:
                note("floor, a Ray job that runs `true` with the head job's runtime env, "
                     "submitted straight to the dashboard: submitted → ended "
                     f"{[round(x) for x in FLOORS]} ms (median {statistics.median(FLOORS):.0f})")
            if BY_HAND:
                note("each step's floor, by hand in the same image and pods, beside the "
                     "launches' (test_p5_floor_of_each_step_by_hand):\n"
                     + timeline.floors_table(LAUNCHES, BY_HAND))  # fmt: skip
            note(json.dumps({**timeline.summary(LAUNCHES),
                             "p5_floor_by_hand_ms": {k: round(v) for k, v in BY_HAND.items()}}))


#: The EndpointSlice watch, the apply time, and each launch's timeline, for the p5 figures.
ROUTES: list[timeline.RouteWatch] = []
APPLIED: list[float] = []
LAUNCHES: list[timeline.Launch] = []
#: The floor of a Ray job's start in these pods, ms (test_p5_floor_of_a_ray_jobs_start).
FLOORS: list[float] = []
#: Each step's floor by hand, ms, by timeline step (test_p5_floor_of_each_step_by_hand).
BY_HAND: dict[str, float] = {}
#: Each fault scenario's line (failed/total, rate, outage), printed at the module's end.
FAULTS: dict[str, str] = {}


def launch_of(v: Vdp, label: str, applied: float, joined: bool,
              routed_on_health: bool = True) -> timeline.Launch:
    """The steps of the launch that now serves: its head job's stage lines in the head
    container's log, Ray's node table, and the slice watch (where the route follows the
    first healthy answer: a Surge's switch waits for a completion instead)."""
    job = v.status()["headJob"]
    pods = v.pods()
    log = v.cluster.kubectl("logs", pods["head"]["metadata"]["name"], "-n", v.ns, "-c",
                            "ray-head").stdout  # fmt: skip
    stages = timeline.stage_times(log, job)
    if not {timeline.ENGINE_STARTING, timeline.SERVING} <= set(stages):
        sid = v.rayjob(job)["status"]["jobId"]  # type: ignore[index]
        head = pods["head"]["metadata"]["name"]
        proc1 = v.cluster.exec(v.ns, head, "sh", "-c", "id; ls -l /proc/1/fd/1; "
                               "tr '\\0' ' ' < /proc/1/cmdline", check=False)  # fmt: skip
        raise AssertionError(
            f"the launcher's stage lines for {job} are not in the head container's log:\n"
            f"{log[-2000:]}\n--- its Ray job log:\n{v.job_logs(sid)[-3000:]}\n--- the head "
            f"container's PID 1:\n{proc1.stdout}{proc1.stderr}")  # fmt: skip
    routed = v.wait("the route seen by the watch", lambda: ROUTES[0].routed_after(
        stages[timeline.SERVING] - 5), 30) if routed_on_health else None  # fmt: skip
    nodes = http(v.dashboard_url("/api/v0/nodes?detail=1&limit=100"), timeout=10,
                 headers=v.ray_headers())["data"]["result"]["result"]  # fmt: skip
    rayjob = v.rayjob(job)
    steps = {name: stages[name] for name in (timeline.CONNECTING, timeline.PREFLIGHT)
             if name in stages}  # fmt: skip
    if joined:
        steps["pods Ready"] = timeline.ready_at(list(pods.values()))
    if rayjob is not None:
        steps["head job created"] = timeline.created_at(rayjob)
    submitted = ray_job_start(v, job)
    if submitted is not None:
        steps[timeline.SUBMITTED] = submitted
    return timeline.Launch(label, applied,
                           timeline.started_at(list(pods.values())) if joined else None,
                           timeline.last_join(nodes) if joined else None,
                           stages[timeline.ENGINE_STARTING], stages[timeline.SERVING],
                           routed, steps)  # fmt: skip


def ray_job_start(v: Vdp, submission_id: str) -> float | None:
    """When Ray took the job's submission (epoch seconds), from its job table."""
    start = (v.dashboard_jobs().get(submission_id) or {}).get("start_time")
    return start / 1000 if start else None


def completion(url: str, via: Any) -> dict[str, Any]:
    out: dict[str, Any] = via(f"{url}/v1/completions",
                              {"model": "tiny", "prompt": "hello world", "max_tokens": 4},
                              headers=AUTH)  # fmt: skip
    return out


def test_serving_on_two_nodes_and_answers(vdp: Vdp) -> None:
    pods = vdp.pods()
    assert pods["head"]["spec"]["nodeName"] != pods["worker"]["spec"]["nodeName"]
    ip = vdp.service_ip()
    host = f"http://{ip}:{API_PORT}"
    dns = f"http://{vdp.name}-api.{vdp.ns}.svc.cluster.local:{API_PORT}"
    for base, via in ((host, http), (dns, vdp.from_pod)):
        out = completion(base, via)
        assert out["object"] == "text_completion" and out["model"] == "tiny"
        assert out["usage"]["completion_tokens"] >= 1 and len(out["choices"]) == 1
        chat = via(f"{base}/v1/chat/completions", {"model": "tiny", "max_tokens": 4,
                   "messages": [{"role": "user", "content": "hello"}]}, headers=AUTH)  # fmt: skip
        assert chat["object"] == "chat.completion"
        assert chat["choices"][0]["message"]["role"] == "assistant"


def test_restricted_namespace_admits_the_ray_pods_and_they_run_restricted(vdp: Vdp) -> None:
    ns = vdp.cluster.kubectl_json("get", "namespace", vdp.ns)["metadata"]["labels"]
    assert ns["pod-security.kubernetes.io/enforce"] == "restricted"
    for pod in vdp.pods().values():
        spec = pod["spec"]
        assert spec["automountServiceAccountToken"] is False
        for c in spec["containers"] + spec.get("initContainers", []):
            ctx = c["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False and ctx["runAsNonRoot"], c["name"]


def test_the_api_key_is_required_and_health_stays_open(vdp: Vdp) -> None:
    base = f"http://{vdp.service_ip()}:{API_PORT}"
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
    assert http_status(f"{base}/v1/completions", body=body) == 401
    assert http_status(f"{base}/v1/completions", {"Authorization": "Bearer wrong"}, body) == 401
    assert http_status(f"{base}/v1/completions", AUTH, body) == 200
    # The operator's probe reads /health without a key; so does this, and it answers.
    assert http_status(f"{base}/health") == 200
    # The key reaches the pods by reference only: no literal in the RayCluster or RayJob.
    for kind in ("raycluster", "rayjob"):
        text = vdp.cluster.kubectl("get", kind, "-n", vdp.ns, "-o", "json").stdout
        assert API_KEY not in text, kind


def test_the_ray_dashboard_refuses_a_request_without_the_token(vdp: Vdp) -> None:
    cluster = vdp.cluster.kubectl_json("get", "raycluster", vdp.status()["rayCluster"],
                                       "-n", vdp.ns)  # fmt: skip
    # The Secret's name says the operator's key id and a tag only its key derives.
    secret = cluster["spec"]["authOptions"]["secretName"]
    assert cluster["spec"]["authOptions"]["mode"] == "token"
    assert re.fullmatch(rf"{vdp.name}-ray-token-[0-9a-f]{{16}}", secret), secret
    head = vdp.pods()["head"]
    env = {e["name"]: e for e in head["spec"]["containers"][0]["env"]}
    assert env["RAY_AUTH_MODE"]["value"] == "token"  # set by KubeRay
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": secret, "key": "auth_token"}
    jobs = vdp.dashboard_url("/api/jobs/")
    assert http_status(jobs) == 401
    assert http_status(jobs, {"x-ray-authorization": "Bearer wrong"}) == 403
    assert http_status(jobs, {"Authorization": "Bearer wrong"}) == 403
    # A job submitted without the token is refused: no code runs on the GPU pods.
    assert http_status(jobs, body={"entrypoint": "echo pwned"}) == 401
    assert http_status(jobs, vdp.ray_headers()) == 200
    assert all(j.get("entrypoint") != "echo pwned" for j in vdp.dashboard_jobs().values())
    # Its public health check stays open for KubeRay's probes.
    assert http_status(vdp.dashboard_url("/api/gcs_healthz")) == 200


@pytest.mark.floor
def test_p5_floor_of_a_ray_jobs_start(vdp: Vdp) -> None:
    """Issue 22's per-step floor for the head job's start: the same cluster runs a job of
    `true` with the head job's runtime env (its env_vars), submitted straight to the dashboard
    with no KubeRay in between, three times; submitted → ended is what Ray alone takes to
    start a job's entrypoint in these pods."""
    head_job = vdp.rayjob(vdp.status()["headJob"])
    assert head_job is not None
    env = json.loads(head_job["spec"]["runtimeEnvYAML"])
    jobs = vdp.dashboard_url("/api/jobs/")
    for n in range(3):
        sid = f"floor-{int(time.time())}-{n}"
        http(jobs, {"entrypoint": "true", "submission_id": sid, "runtime_env": env},
             timeout=30, headers=vdp.ray_headers())  # fmt: skip

        def ended(sid: str = sid) -> dict[str, Any] | None:
            job = vdp.dashboard_jobs().get(sid)
            return job if job and job.get("end_time") else None

        info = vdp.wait(f"the floor job {sid} to end", ended, 60, interval=0.2)
        assert info["status"] == "SUCCEEDED", info
        FLOORS.append(info["end_time"] - info["start_time"])
    assert len(FLOORS) == 3


def finished_by_engine(metrics: str) -> dict[str, float]:
    """vllm:request_success_total summed per `engine` label."""
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("vllm:request_success_total{"):
            engine = re.search(r'engine="(\d+)"', line)
            if engine:
                out[engine[1]] = out.get(engine[1], 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_both_engines_finish_requests(vdp: Vdp) -> None:
    base = f"http://{vdp.service_ip()}:{API_PORT}"
    for _ in range(20):
        completion(base, http)
    done = finished_by_engine(http(f"{base}/metrics"))
    assert done.get("0", 0) > 0 and done.get("1", 0) > 0, done
    assert sum(done.values()) >= 20, done


def write_pod_targets(vdp: Vdp, path: Path) -> None:
    """Every pod of the bed (all namespaces, as the PodMonitor's `any: true` asks) as
    kubernetes_sd would label them, for Prometheus' file_sd (written whole, then renamed)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(pod_targets(
        vdp.cluster.kubectl_json("get", "pods", "--all-namespaces")["items"])))  # fmt: skip
    tmp.replace(path)


def pod_monitor_prometheus(vdp: Vdp, workdir: Path, host: str = "127.0.0.1") -> Prometheus:
    """Prometheus scraping what the chart's engine PodMonitor selects: the PodMonitor as
    `helm template` renders it with the bed's install values and monitoring on, its job fed
    the bed's pods (write_pod_targets, at the start; again as pods come and go where the
    caller refreshes it)."""
    (monitor,) = [o for o in operatorchart.template("metrics.podMonitor.enabled=true")
                  if o["kind"] == "PodMonitor"]  # fmt: skip
    workdir.mkdir(parents=True, exist_ok=True)
    pods = workdir / "pods.json"
    write_pod_targets(vdp, pods)
    prom = Prometheus(workdir, [scrape_config_from_pod_monitor(monitor, file_sd(pods))],
                      host=host)  # fmt: skip
    prom.start()
    return prom


def finished_in_prometheus(prom: Prometheus, vdp: Vdp) -> dict[str, float]:
    """vllm:request_success_total per engine, selected by the PodMonitor's relabelled
    name and namespace labels."""
    expr = (f'sum by (engine) (vllm:request_success_total{{vllmdataparallel="{vdp.name}",'
            f'namespace="{vdp.ns}"}})')  # fmt: skip
    return {r["metric"]["engine"]: float(r["value"][1]) for r in prom.query(expr)}


def in_flight_in_prometheus(prom: Prometheus, vdp: Vdp) -> dict[str, float]:
    """Requests running plus waiting per engine, from vLLM's own gauges in Prometheus."""
    sel = f'{{vllmdataparallel="{vdp.name}",namespace="{vdp.ns}"}}'
    expr = (f"sum by (engine) (vllm:num_requests_running{sel}) + "
            f"sum by (engine) (vllm:num_requests_waiting{sel})")  # fmt: skip
    return {r["metric"]["engine"]: float(r["value"][1]) for r in prom.query(expr)}


class Load:
    """Requests kept in flight from threads until stopped: each generates `tokens` tokens
    (ignore_eos), and a finished one is replaced at once, so the engines stay busy for as
    long as the test watches, whatever the probe's phase."""

    def __init__(self, base: str, threads: int, tokens: int) -> None:
        self.base, self.tokens = base, tokens
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.done = 0
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                http(f"{self.base}/v1/completions", {
                    "model": "tiny", "prompt": "hello world", "max_tokens": self.tokens,
                    "ignore_eos": True}, timeout=120, headers=AUTH)  # fmt: skip
                with self.lock:
                    self.done += 1
            except OSError as e:
                self.errors.append(repr(e))
                time.sleep(0.5)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=150)


def vdp_columns(vdp: Vdp) -> dict[str, str]:
    """`kubectl get vdp NAME` as header -> value."""
    return kubectl_table(vdp.cluster.kubectl("get", "vdp", vdp.name, "-n", vdp.ns).stdout)[0]


# --- LoRA adapters (issue 40) ----------------------------------------------------------------

LORA = "/models/tiny-lora"
#: The example's adapters.
ADAPTERS = {"sql": f"{LORA}/sql", "chat": f"{LORA}/chat"}


def ask(url: str, model: str, rank: int | None = None) -> int:
    """One completion of `model` through the Service, pinned to a DP rank where given
    (vLLM's X-data-parallel-rank header); its HTTP status, 0 when nothing answered."""
    headers = dict(AUTH)
    if rank is not None:
        headers["X-data-parallel-rank"] = str(rank)
    try:
        return http_status(f"{url}/v1/completions", headers,
                           {"model": model, "prompt": "hello world", "max_tokens": 2})
    except OSError:
        return 0


def listed(url: str) -> set[str]:
    return {m["id"] for m in http(f"{url}/v1/models", headers=AUTH)["data"]}


def lora_condition(vdp: Vdp) -> dict[str, Any]:
    return next((c for c in vdp.status().get("conditions") or [] if c["type"] == "LoRAReady"),
                {})  # fmt: skip


def test_lora_adapters_answer_on_every_rank(vdp: Vdp) -> None:
    url = f"http://{vdp.service_ip()}:{API_PORT}"
    assert listed(url) >= {"tiny", "sql", "chat"}
    before = finished_by_engine(http(f"{url}/metrics"))
    for name in ("sql", "chat"):
        for rank in (0, 1):
            assert ask(url, name, rank) == 200, (name, rank)
    after = finished_by_engine(http(f"{url}/metrics"))
    # Pinned: each engine finished the two adapters' requests sent to it.
    assert all(after.get(e, 0) - before.get(e, 0) >= 2 for e in ("0", "1")), (before, after)
    assert ask(url, "json") == 404  # not in the spec: vLLM does not know it
    st = vdp.wait("status.lora ready 2/2", lambda: (s := vdp.status()).get("lora", {}).get(
        "ready") == "2/2" and s, 60)  # fmt: skip
    assert [a["replicas"] for a in st["lora"]["adapters"]] == [[0], [0]], st["lora"]
    assert lora_condition(vdp)["status"] == "True"


def test_lora_users_cannot_change_adapters_even_with_the_api_key(vdp: Vdp) -> None:
    url = f"http://{vdp.service_ip()}:{API_PORT}"
    body = {"lora_name": "json", "lora_path": f"{LORA}/json"}
    assert http_status(f"{url}/v1/load_lora_adapter", AUTH, body) == 403
    assert http_status(f"{url}/v1/unload_lora_adapter", AUTH, {"lora_name": "sql"}) == 403
    assert http_status(f"{url}/adapters", AUTH, body) == 403
    assert ask(url, "json") == 404 and ask(url, "sql") == 200


def test_lora_added_and_removed_on_the_running_engines_with_no_failed_request(
        vdp: Vdp) -> None:  # fmt: skip
    url = f"http://{vdp.service_ip()}:{API_PORT}"
    st = vdp.status()
    job = st["headJob"]
    uid, sid = (vdp.rayjob(job) or {})["metadata"]["uid"], vdp.rayjob(job)["status"]["jobId"]  # type: ignore[index]
    started = vdp.dashboard_jobs()[sid]["start_time"]
    # Two clients on the base model: a new connection per request, and kept-alive ones.
    with Traffic(vdp.cluster, vdp.ns, url, "tiny", f"{IMAGE}:dev", name="traffic-lora",
                 rate=10, api_key_secret=("api-key", "key")) as t, \
            Traffic(vdp.cluster, vdp.ns, url, "tiny", f"{IMAGE}:dev", name="kept-lora",
                    rate=10, api_key_secret=("api-key", "key"), keep_alive=True) as k:  # fmt: skip
        t0 = time.monotonic()
        vdp.cluster.apply(example(vdp.ns, adapters={**ADAPTERS, "json": f"{LORA}/json"}))
        vdp.wait("json to answer on both ranks", lambda: ask(url, "json", 0) == 200
                 and ask(url, "json", 1) == 200, 30, interval=0.5)  # fmt: skip
        added = time.monotonic() - t0
        t1 = time.monotonic()
        vdp.cluster.apply(example(vdp.ns, adapters={"sql": ADAPTERS["sql"],
                                                    "json": f"{LORA}/json"}))  # fmt: skip
        vdp.wait("chat to be gone", lambda: ask(url, "chat") == 404, 30, interval=0.5)
        removed = time.monotonic() - t1
        time.sleep(2)
    note(f"LoRA: an added adapter answered on both ranks {added:.1f}s after apply, a removed "
         f"one answered 404 {removed:.1f}s after; base model {t.summary()}; kept-alive "
         f"{k.summary()}")  # fmt: skip
    for client in (t, k):
        why = (f"{client.summary()}\nfirst failures: "
               f"{json.dumps(client.result['failures'][:15], indent=1)}\n--- traffic client "
               f"log\n{client.logs()}\n{vdp.diagnostics()}")  # fmt: skip
        assert client.result["failed"] == 0 and client.result["rate"] >= 5, why
    assert ask(url, "sql") == 200
    now = vdp.rayjob(vdp.status()["headJob"])
    assert now is not None and now["metadata"]["uid"] == uid  # the same head job
    assert vdp.dashboard_jobs()[sid]["start_time"] == started and (
        vdp.dashboard_jobs()[sid]["status"] == "RUNNING")  # fmt: skip
    vdp.cluster.apply(example(vdp.ns))  # the example's own adapters again
    vdp.wait("chat back", lambda: ask(url, "chat") == 200, 30, interval=0.5)


def test_lora_a_bad_adapter_is_reported_and_the_rest_serve(vdp: Vdp) -> None:
    url = f"http://{vdp.service_ip()}:{API_PORT}"
    vdp.cluster.apply(example(vdp.ns, adapters={**ADAPTERS, "missing": f"{LORA}/missing",
                                                "wide": f"{LORA}/wide"}))  # fmt: skip
    cond = vdp.wait("LoRAReady False naming both", lambda: (c := lora_condition(vdp)).get(
        "reason") == "AdapterFailed" and "missing" in c["message"] and "wide" in c["message"]
        and c, 60)  # fmt: skip
    assert cond["status"] == "False"
    errors = {a["name"]: a.get("error") for a in vdp.status()["lora"]["adapters"]}
    assert errors["sql"] is None and errors["chat"] is None, errors
    assert "404" in errors["missing"] and "wide" in errors and errors["wide"], errors
    events = vdp.cluster.kubectl("get", "events", "-n", vdp.ns, "--field-selector",
                                 f"involvedObject.name={vdp.name},reason=AdapterFailed"
                                 ).stdout  # fmt: skip
    assert "missing" in events and "wide" in events, events
    assert ask(url, "tiny") == 200 and ask(url, "sql") == 200 and ask(url, "chat") == 200
    assert ask(url, "missing") == 404
    vdp.cluster.apply(example(vdp.ns))
    vdp.wait("LoRAReady True again", lambda: lora_condition(vdp).get("status") == "True", 60)


def test_prometheus_scrapes_vllm_and_status_load_follows(
    vdp: Vdp, tmp_path: Path
) -> None:
    base = f"http://{vdp.service_ip()}:{API_PORT}"
    head = vdp.pods()["head"]["metadata"]["name"]
    prom = pod_monitor_prometheus(vdp, tmp_path / "prometheus")

    def wait(what: str, check: Any, timeout: float) -> Any:
        try:
            return vdp.wait(what, check, timeout)
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- prometheus targets\n"
                                 f"{json.dumps(prom.targets(), indent=1)[-4000:]}\n"
                                 f"--- prometheus log\n{prom.log_tail()}") from None

    try:
        # The PodMonitor's selector and port pick the head's serving port, and no other pod
        # of this namespace (pods of other tiers' namespaces may still be terminating).
        (target,) = wait("one healthy scrape target in the namespace", lambda: (t := [
            x for x in prom.targets() if x["labels"].get("namespace") == vdp.ns]) and all(
            x["health"] == "up" for x in t) and t, 60)  # fmt: skip
        labels = target["labels"]
        assert (labels["pod"], labels["namespace"], labels["vllmdataparallel"]) == (
            head, vdp.ns, vdp.name), labels
        assert target["scrapeUrl"].endswith(f":{API_PORT}/metrics"), target
        before = wait("request_success_total of engines 0 and 1 in Prometheus", lambda: (
            f := finished_in_prometheus(prom, vdp)).keys() >= {"0", "1"} and f, 60)  # fmt: skip
        # Idle first: both ranks report, nothing running (the earlier requests are done).
        idle = wait("status.load: both ranks reporting, Idle", lambda: (
            ld := vdp.status().get("load") or {}).get("ranksReporting") == 2 and ld.get(
            "level") == "Idle" and ld, 120)  # fmt: skip
        note(f"idle: status.load {idle}; Prometheus finished {before}")

        def loaded() -> dict[str, Any] | None:
            # Each rank busy, in vLLM's own per-rank series (status holds no per-rank numbers),
            # and the summary level moved off Idle, in status and in the LOAD column.
            busy = in_flight_in_prometheus(prom, vdp)
            if sorted(e for e, n in busy.items() if n > 0) != ["0", "1"]:
                return None
            st = vdp.status()
            level = (st.get("load") or {}).get("level")
            if level not in ("Busy", "Saturated"):
                return None
            return st if vdp_columns(vdp)["LOAD"] == level else None

        t0 = time.monotonic()
        with Load(base, threads=12, tokens=200) as load:
            # A level stands a minute before a new one replaces it, then the next probe says.
            st = wait("both ranks busy in Prometheus, status.load off Idle", loaded, 150)
            note(f"under load after {time.monotonic() - t0:.0f}s: status.load {st['load']}, "
                 f"in flight per engine {in_flight_in_prometheus(prom, vdp)}")  # fmt: skip
        assert "engines" not in st and "requestsRunning" not in st, st
        note(f"load: {load.done} requests finished, {len(load.errors)} errors")
        assert load.done > 0 and not load.errors, load.errors[:5]
        # Every request the load finished, counted on both engines.
        after = wait("Prometheus' request_success_total grown on engines 0 and 1", lambda: (
            f := finished_in_prometheus(prom, vdp)) and all(
            f.get(e, 0) > before[e] for e in ("0", "1")) and sum(f.values()) - sum(
            before.values()) >= load.done and f, 60)  # fmt: skip
        note(f"Prometheus finished per engine: {before} -> {after}")
    finally:
        prom.stop()


class PodTargets:
    """write_pod_targets every second in a thread, so Prometheus scrapes a new replica's head
    pod as soon as it has an address (what kubernetes_sd does)."""

    def __init__(self, vdp: Vdp, path: Path) -> None:
        self.vdp, self.path, self.stop = vdp, path, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(1.0):
            with contextlib.suppress(Exception):  # a failed read leaves the last file
                write_pod_targets(self.vdp, self.path)

    def __enter__(self) -> PodTargets:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


def keda(cluster: RunningCluster, cmd: str) -> None:
    """`testbed.py cluster keda-up|keda-down` (kedabed.py: KEDA from its own manifests)."""
    proc = testbed_cli(cmd, timeout=1800)
    sys.stderr.write(proc.stderr[-2000:])
    if proc.returncode != 0:
        raise AssertionError(f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}\n"
                             f"{cluster.diagnostics('keda')}")  # fmt: skip


def failed_after(client: Traffic, at: float) -> list[dict[str, Any]]:
    """The client's failed requests sent at `at` or later, and its runs of failures that
    began then (the tally keeps the latest failures, and every run)."""
    res = client.result
    return ([f for f in res["failures"] if f["sent"] >= at]
            + [o for o in res["outages"] if o["from"] >= at])  # fmt: skip


@pytest.mark.keda
def test_keda_scales_on_vllms_queue_and_back_with_no_failed_request(
        vdp: Vdp, tmp_path: Path, request: pytest.FixtureRequest) -> None:  # fmt: skip
    """Issue 37's autoscaling on real vLLM CPU engines: KEDA, installed from its own manifests
    (kedabed.py), with its metrics API server behind the API server's aggregation layer; a
    real Prometheus scraping the heads through the chart's PodMonitor; the chart's own
    ScaledObject (autoscaling.scaledObjects) on vllm:num_requests_waiting. A load that
    queues requests makes KEDA ask for a second replica by itself; the load stops there (on
    the bed's two shared cores, engines with a queue leave a new replica no CPU: its worker's
    raylet timed out starting), the second replica boots, is routed and answers on its own;
    after the scale-down window KEDA takes the resource back to 1, the leaving replica drained
    first. Two counting clients (a new connection per request, and kept-alive connections)
    lose nothing from the load's end on. Reported: the time from the queue building to the
    second replica routed."""
    cluster = vdp.cluster
    vdp.wait_phase("Serving", 600)
    vdp.wait("one replica, no update", lambda: vdp.ready_replicas(1) and "update" not in
             vdp.status(), 300)  # fmt: skip
    keda(cluster, "keda-up")
    request.addfinalizer(lambda: keda(cluster, "keda-down"))
    workdir = tmp_path / "prometheus"
    # On the bed's own address: KEDA's operator, in a pod, asks it.
    prom = pod_monitor_prometheus(vdp, workdir, host=hostnet.API_IP)
    request.addfinalizer(prom.stop)
    entry = "autoscaling.scaledObjects[0]"
    # Longer than the second replica's boot (5 min here), so it is routed before the
    # window that began when the queue went lets KEDA take it away again.
    window = 480
    (so,) = [o for o in operatorchart.template(
        f"{entry}.name={vdp.name}", f"{entry}.namespace={vdp.ns}",
        f"{entry}.prometheusAddress={prom.url}", f"{entry}.maxReplicas=2",
        f"{entry}.waitingPerReplica=2", f"{entry}.kvCacheUsage=0",
        f"{entry}.pollingInterval=5", f"{entry}.scaleDownStabilizationSeconds={window}")
        if o["kind"] == "ScaledObject"]  # fmt: skip
    cluster.apply(so)
    request.addfinalizer(lambda: cluster.kubectl("delete", "scaledobject", vdp.name, "-n",
                                                 vdp.ns, "--ignore-not-found", check=False))
    hpa = f"keda-hpa-{vdp.name}"
    waiting = (f'sum(vllm:num_requests_waiting{{namespace="{vdp.ns}",'
               f'vllmdataparallel="{vdp.name}"}})')  # fmt: skip

    def explain() -> str:
        kc = cluster.kubectl
        so_status = kc("get", "scaledobject", vdp.name, "-n", vdp.ns, "-o",
                       "jsonpath={.status}", check=False)  # fmt: skip
        operator = kc("logs", "deploy/keda-operator", "-n", "keda", "--tail=40", check=False)
        return (f"--- HPA\n{kc('describe', 'hpa', hpa, '-n', vdp.ns, check=False).stdout}\n"
                f"--- ScaledObject status\n{so_status.stdout}{so_status.stderr}\n"
                f"--- KEDA operator\n{operator.stdout}"
                f"\n--- prometheus targets\n{json.dumps(prom.targets(), indent=1)[-3000:]}")

    def wait(what: str, check: Any, timeout: float) -> Any:
        try:
            return vdp.wait(what, check, timeout)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{explain()}") from None

    # KEDA reads the metric through the aggregation layer: the HPA it made has a value.
    wait("KEDA's HPA reading the queue", lambda: cluster.kubectl_json(
        "get", "hpa", hpa, "-n", vdp.ns).get("status", {}).get("currentMetrics"), 180)
    assert vdp.get()["spec"].get("replicas", 1) == 1
    url = f"http://{vdp.service_ip()}:{API_PORT}"
    with PodTargets(vdp, workdir / "pods.json"), \
            Traffic(cluster, vdp.ns, url, "tiny", f"{IMAGE}:dev", name="new-keda", rate=2,
                    api_key_secret=("api-key", "key")) as new, \
            Traffic(cluster, vdp.ns, url, "tiny", f"{IMAGE}:dev", name="kept-keda", rate=2,
                    api_key_secret=("api-key", "key"), keep_alive=True) as kept:  # fmt: skip
        # More requests than the engines run at once (--max-num-seqs=8 on each of 2): vLLM
        # queues the rest, and vllm:num_requests_waiting says so.
        with Load(url, threads=24, tokens=64) as load:
            queued = wait("the queue building in Prometheus", lambda: (
                (prom.value(waiting) or 0) >= 2 and time.time()), 120)  # fmt: skip
            scaled = wait("KEDA's HPA asking for 2 replicas", lambda: vdp.get()["spec"].get(
                "replicas") == 2 and time.time(), 180)  # fmt: skip
        stopped = time.time()
        st = wait("the second replica routed", lambda: vdp.ready_replicas(2), window)
        routed = time.time()
        by_replica = vdp.heads()
        ips = {p["status"]["podIP"] for p in by_replica.values()}
        ready_ips = replicasteps.ready_in_slice(vdp)
        answers = {i: completion(f"http://{p['status']['podIP']}:{API_PORT}", http)["object"]
                   for i, p in by_replica.items()}  # fmt: skip
        note(f"KEDA: 2 replicas asked {scaled - queued:.0f}s after the queue, routed "
             f"{routed - queued:.0f}s after it; load {load.done} done, {len(load.errors)} "
             "errors")  # fmt: skip
        down = wait("KEDA's HPA back to 1 replica", lambda: vdp.get()["spec"].get(
            "replicas") == 1 and time.time(), window + 300)  # fmt: skip
        vdp.wait("one RayCluster left after the drain", lambda: len(vdp.live_clusters()) == 1,
                 300)  # fmt: skip
        gone = time.time()
        vdp.wait("one replica routed", lambda: vdp.ready_replicas(1), 120)
        time.sleep(5)  # one replica alone, with traffic flowing
    FAULTS["KEDA 1 -> 2 (queue to the second replica routed)"] = (
        f"{routed - queued:.0f}s (HPA asked {scaled - queued:.0f}s after the queue)")
    for c in (new, kept):
        FAULTS[f"KEDA 2 -> 1 ({c.name}, from the load's end)"] = (
            f"{c.summary()}; 2 routed to 1 asked {down - routed:.0f}s, to the replica gone "
            f"{gone - routed:.0f}s")  # fmt: skip
    assert load.done > 0, load.errors[:5]
    assert st["phase"] == "Serving" and sorted(by_replica) == ["0", "1"], st
    assert ready_ips == ips and len(ips) == 2, (ready_ips, ips)
    assert answers == {"0": "text_completion", "1": "text_completion"}, answers
    for c in (new, kept):
        after = failed_after(c, stopped)
        assert after == [], (f"{c.name}: {c.summary()}\n{json.dumps(after, indent=1)}\n"
                             f"{json.dumps(c.result['failures'][-10:], indent=1)}")  # fmt: skip
    assert vdp.get()["spec"]["replicas"] == 1 and vdp.status()["readyReplicas"] == 1


#: The rolling scenario's engine change at two replicas (D's Surge, later, goes to 192).
ROLLED_MAX_MODEL_LEN = 160


@pytest.fixture(scope="module")
def replicas(vdp: Vdp, request: pytest.FixtureRequest) -> Iterator[replicasteps.Scene]:
    """Issue 37's replica scenarios (replicasteps.py) on this deployment, as the engine double
    runs them in `make test`. Two replicas of the example take 3 of the bed's nodes (a head's
    2 CPUs each, the workers' 1); a drained node's pods need a fourth."""
    nodes = len(vdp.cluster.node_names)
    assert nodes >= 4, (f"two replicas of {EXAMPLE.name} and a node drain need 4 nodes; this "
                        f"bed has {nodes}: `make test-replicas-vllm` starts one with 4")
    url = f"http://{vdp.service_ip()}:{API_PORT}"

    def clients(scenario: str) -> tuple[Traffic, Traffic]:
        return tuple(Traffic(vdp.cluster, vdp.ns, url, "tiny", f"{IMAGE}:dev",
                             name=f"{'kept' if kept else 'new'}-r-{scenario}", rate=4,
                             api_key_secret=("api-key", "key"), keep_alive=kept)
                     for kept in (False, True))  # type: ignore[return-value]  # fmt: skip

    def changed() -> dict[str, Any]:
        doc = example(vdp.ns, max_model_len=ROLLED_MAX_MODEL_LEN)
        doc["spec"]["replicas"] = 2
        doc["spec"]["update"] = {"strategy": "RollingUpdate", "maxSurge": 0,
                                 "maxUnavailable": 1, "drainSeconds": 10}  # fmt: skip
        return doc

    def runs_changed(ip: str) -> bool:
        models = http(f"http://{ip}:{API_PORT}/v1/models", headers=AUTH)
        return bool(models["data"][0]["max_model_len"] == ROLLED_MAX_MODEL_LEN)

    lines: dict[str, str] = {}
    yield replicasteps.Scene(vdp, clients, lambda ip: completion(f"http://{ip}:{API_PORT}",
                                                                 http)["object"],
                             changed, runs_changed, lines, boot=600,
                             served_by=False)  # fmt: skip
    report(request, "availability, real vLLM", lines)


@pytest.mark.replicas_vllm
@pytest.mark.parametrize("scenario", replicasteps.SCENARIOS, ids=lambda f: f.__name__)
def test_replicas_on_real_vllm(replicas: replicasteps.Scene,
                               scenario: Callable[[replicasteps.Scene], None]) -> None:  # fmt: skip
    scenario(replicas)


@pytest.mark.floor
def test_engine_only_change_relaunches_on_same_pods_with_probes_off(vdp: Vdp) -> None:
    """Issue 17's scenario G on real vLLM: with healthProbe.mode off the operator sends no
    probe, and the relaunch serves on the launcher's own report alone. A launch timeline's
    sample for `make bench-p5`; `make test` runs G on the engine double
    (test_operator_double.py), which costs no vLLM relaunch."""
    operator_values("healthProbe.mode=off")
    try:
        st = vdp.status()
        old_job = st["headJob"]
        old_sid = vdp.rayjob(old_job)["status"]["jobId"]  # type: ignore[index]
        uids = {role: p["metadata"]["uid"] for role, p in vdp.pods().items()}
        t0 = time.monotonic()
        applied = time.time()
        vdp.cluster.apply(example(vdp.ns, max_model_len=128))
        new = vdp.wait("a new head job", lambda: (s := vdp.status()).get("headJob") != old_job
                       and s.get("headJob"), 180)  # fmt: skip
        served = vdp.wait_phase("Serving", 600, job=new)
        note(f"relaunch after an engine-only change, probes off: Serving again in "
             f"{time.monotonic() - t0:.0f}s")  # fmt: skip
        ready = next(c for c in served["conditions"] if c["type"] == "Ready")
        assert "the launcher reports" in ready["message"], ready
        assert {role: p["metadata"]["uid"] for role, p in vdp.pods().items()} == uids
        assert vdp.dashboard_jobs()[old_sid]["status"] in ("STOPPED", "SUCCEEDED", "FAILED")
        models = http(f"http://{vdp.service_ip()}:{API_PORT}/v1/models", headers=AUTH)
        assert models["data"][0]["max_model_len"] == 128
        out = completion(f"http://{vdp.service_ip()}:{API_PORT}", http)
        assert out["object"] == "text_completion"
        LAUNCHES.append(launch_of(vdp, "engine-only change (probes off)", applied,
                                  joined=False))  # fmt: skip
    finally:
        operator_values()  # the bed's own values again, probes on


class Poller:
    """Runs `tick` every half second in a thread, from the host, for the `with` block."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def tick(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.tick()

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(60)


class AdapterWatch(Poller):
    """Asks the base model, then each adapter, through the Service every half second, from
    the host, and keeps each round's statuses: whether a relaunch was routed before its
    adapters were back."""

    def __init__(self, url: str, adapters: list[str]) -> None:
        super().__init__()
        self.url, self.adapters = url, adapters
        self.rounds: list[tuple[float, int, dict[str, int]]] = []

    def tick(self) -> None:
        base = ask(self.url, "tiny")
        self.rounds.append((time.time(), base, {a: ask(self.url, a) for a in self.adapters}
                            if base == 200 else {}))  # fmt: skip

    def back_without_adapters(self) -> list[tuple[float, dict[str, int]]]:
        """Rounds after the outage in which the base model answered and an adapter did not."""
        down = next((i for i, r in enumerate(self.rounds) if r[1] != 200), None)
        if down is None:
            return []
        return [(at, got) for at, base, got in self.rounds[down:]
                if base == 200 and any(code != 200 for code in got.values())]


class HealthWatch(Poller):
    """Every half second, from the host: the addresses the slice says are ready (its watch's
    last line), each one's own GET /health, then the slice again. A sample holds against the
    slice only where the address was ready both before and after its probe: "at every moment
    the slice says ready, the head pod answers"."""

    def __init__(self, watch: timeline.RouteWatch) -> None:
        super().__init__()
        self.watch = watch
        self.samples: list[tuple[float, dict[str, int]]] = []

    def _ready(self) -> set[str]:
        return timeline.ready_addresses(self.watch.seen[-1][1]) if self.watch.seen else set()

    def tick(self) -> None:
        before = self._ready()
        codes = {a: health(a) for a in sorted(before)}
        after = self._ready()
        self.samples.append((time.time(), {a: codes[a] for a in before & after}))

    def unhealthy(self) -> list[tuple[float, str, int]]:
        """The samples in which a ready address did not answer 200."""
        return [(at, a, code) for at, codes in self.samples for a, code in codes.items()
                if code != 200]  # fmt: skip


def health(address: str) -> int:
    """A head pod's own vLLM /health, straight to its address: its status, 0 for no answer."""
    try:
        with urllib.request.urlopen(f"http://{address}:{API_PORT}/health", timeout=2) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def test_head_pod_deleted_unroutes_and_serves_again_with_its_adapters(
        vdp: Vdp, request: pytest.FixtureRequest) -> None:  # fmt: skip
    """Issue 17's scenario F on real vLLM, with issue 38's and issue 40's lines: the head pod
    deleted under two counting clients (a new connection per request, and kept-alive ones).
    - At every moment the slice says ready, the ready head pod's own /health answers 200
      (polled every 0.5 s from the host): the dead pod is unrouted, and the new one is routed
      only on its own answer.
    - Every failed request was sent between the delete and the route's return.
    - The relaunch is routed only once its LoRA adapters answer too.
    (A lost worker pod, with the relaunch's backoff, is test_operator_double.py's.)"""
    st = vdp.wait_phase("Serving", 120)
    job = st["headJob"]
    old = vdp.pods()["head"]["metadata"]
    url = f"http://{vdp.service_ip()}:{API_PORT}"
    kubectl = [str(vdp.cluster.bin_dir / "kubectl"), f"--kubeconfig={vdp.cluster.kubeconfig}"]
    slice_watch = timeline.route_watch(kubectl, vdp.ns, f"{vdp.name}-api",
                                       timeline.READY_BY_ADDRESS)  # fmt: skip
    request.addfinalizer(slice_watch.stop)
    adapters = AdapterWatch(url, list(ADAPTERS))
    request.addfinalizer(adapters.__exit__)
    healths = HealthWatch(slice_watch)
    request.addfinalizer(healths.__exit__)
    clients = {kept: Traffic(vdp.cluster, vdp.ns, url, "tiny", f"{IMAGE}:dev",
                             name="kept-f" if kept else "traffic-f", rate=10,
                             api_key_secret=("api-key", "key"), keep_alive=kept)
               for kept in (False, True)}  # fmt: skip
    with clients[False], clients[True]:
        vdp.wait("the slice watch's first line", lambda: slice_watch.seen, 30)
        adapters.__enter__()
        healths.__enter__()
        deleted = time.time()
        vdp.cluster.kubectl("delete", "pod", old["name"], "-n", vdp.ns, "--wait=false")
        unrouted = vdp.wait("the endpoint unrouted", lambda: next((
            at for at, s in slice_watch.seen if at >= deleted
            and not timeline.ready_addresses(s)), None), 60)  # fmt: skip
        head = vdp.wait("a new head pod", lambda: (p := vdp.pods().get("head")) and p[
            "metadata"]["uid"] != old["uid"] and p, 180)  # fmt: skip
        rerouted = vdp.wait("the endpoint routed again", lambda: next((
            at for at, s in slice_watch.seen if at > unrouted
            and timeline.ready_addresses(s)), None), 600)  # fmt: skip
        served = vdp.wait_phase("Serving", 120)
        time.sleep(5)  # the clients see the route's return
        healths.__exit__()
        adapters.__exit__()
    note(f"head pod deleted: unrouted {unrouted - deleted:.1f}s after, routed again "
         f"{rerouted - deleted:.0f}s after; {job} -> {served['headJob']}")  # fmt: skip
    log = vdp.cluster.kubectl("logs", head["metadata"]["name"], "-n", vdp.ns, "-c", "ray-head",
                              check=False).stdout  # fmt: skip
    serving = timeline.stage_times(log, served["headJob"]).get(timeline.SERVING)
    why = (f"slice: {slice_watch.seen}\nhealth: {healths.unhealthy()[:10]}\n"
           f"--- new head's log\n{log[-3000:]}\n{vdp.diagnostics()}")  # fmt: skip
    assert unrouted - deleted < 15, f"unrouted {unrouted - deleted:.1f}s after the delete\n{why}"
    assert serving is not None and rerouted >= serving - 0.2, why
    assert healths.samples and healths.unhealthy() == [], why
    assert any(at > rerouted for at, codes in healths.samples if codes), why
    assert adapters.back_without_adapters() == [], adapters.back_without_adapters()[:10]
    assert adapters.rounds[-1][1] == 200 and set(adapters.rounds[-1][2].values()) == {200}
    returned = rerouted + timeline.KUBE_PROXY_SYNC_S
    for kept, t in clients.items():
        res = t.result
        FAULTS[f"F head pod deleted ({'kept-alive' if kept else 'new connections'})"] = (
            f"{t.summary()}; unrouted {unrouted - deleted:.1f}s after the delete, routed "
            f"again at {rerouted - deleted:.1f}s (vLLM serving on the new head at "
            f"{(serving or 0) - deleted:.1f}s)")  # fmt: skip
        # Every run of failures (by send time) began inside the one outage allowed: from the
        # delete to the route's return on every node; and each ended.
        late = [o for o in res["outages"] if not deleted <= o["from"] < returned or not o["to"]]
        assert res["rate"] >= 5 and res["ok"] > 0, f"{t.summary()}\n{why}"
        assert late == [], f"failures outside the outage: {late[:10]}\n{t.logs()}\n{why}"
    LAUNCHES.append(launch_of(vdp, "head pod deleted", deleted, joined=True))
    assert completion(url, http)["object"] == "text_completion"


def test_surge_to_a_new_max_model_len_with_no_failed_request(vdp: Vdp) -> None:
    """Issue 17's scenario D: an engine change under `Surge` on real vLLM CPU engines. A
    second DP=2 generation comes up beside the one that serves (the bed has a third node for
    its head), the Service moves once it answers, and two clients in pods that kept calling
    the Service the whole time count no failure: one on a new connection per request, one on
    kept-alive connections (issue 38), which stay on the old head through the switch until its
    drain gate answers each with `Connection: close`; its engines stop only after no request
    came there for a while."""
    nodes = len(vdp.cluster.node_names)
    assert nodes >= 3, (f"a Surge of examples/dev-cpu.yaml needs 3 nodes (its head takes a "
                        f"node's 2 CPUs); this bed has {nodes}: `make cluster-up NODES=3`")
    st = vdp.wait_phase("Serving", 600)
    old, job = st["rayCluster"], st["headJob"]
    doc = example(vdp.ns, max_model_len=192)
    doc["spec"]["update"] = {"strategy": "Surge", "drainSeconds": 10}
    # The deadline covers the second generation's boot beside the serving one: 5 to 8 min on
    # the bed's 2 shared cores (8 min 11 s once, 35 s short of the example's 600 s). The test
    # is about the client's failures, not the boot time: twice the example's deadline.
    doc["spec"].setdefault("launch", {})["timeoutSeconds"] = 1200
    url = f"http://{vdp.service_ip()}:{API_PORT}"
    # It asks 10 a second: the client pod asks no CPU (the nodes are the Ray pods'), and
    # while a second generation boots on 2 cores it sends fewer than it asks.
    with Traffic(vdp.cluster, vdp.ns, url, "tiny", f"{IMAGE}:dev", name="traffic-d", rate=10,
                 api_key_secret=("api-key", "key")) as t, \
            Traffic(vdp.cluster, vdp.ns, url, "tiny", f"{IMAGE}:dev", name="kept-d", rate=10,
                    api_key_secret=("api-key", "key"), keep_alive=True) as kept:  # fmt: skip
        applied = time.time()
        vdp.cluster.apply(doc)
        new = vdp.wait_update_started(120)
        assert new != old
        vdp.wait("the switch to the new generation", lambda: vdp.status().get(
            "rayCluster") == new, 1260)  # fmt: skip
        switched = time.time()
        vdp.wait("the old RayCluster gone after its drain", lambda: vdp.live_clusters() == [new],
                 180)  # fmt: skip
        vdp.wait("status.update cleared", lambda: "update" not in vdp.status(), 60)
        time.sleep(5)  # the new generation alone, with traffic flowing
    FAULTS["D Surge to --max-model-len=192"] = (f"{t.summary()}; kept-alive: {kept.summary()}; "
                                                f"apply to switch {switched - applied:.0f}s; "
                                                f"{old} -> {new}")  # fmt: skip
    for client in (t, kept):
        res = client.result
        why = (f"{client.name}: {client.summary()}\nfirst failures: "
               f"{json.dumps(res['failures'][:15], indent=1)}\n--- traffic client log\n"
               f"{client.logs()}\n{vdp.diagnostics()}")  # fmt: skip
        assert res["failed"] == 0 and res["rate"] >= 5, why
    st = vdp.status()
    assert (st["phase"], st["rayCluster"]) == ("Serving", new) and st["headJob"] != job, st
    # The engines want a key, which the operator never holds: the switch waited for the
    # launcher's own completion in the new head pod, with the key (its `answered` line).
    head = vdp.pods()["head"]["metadata"]["name"]
    said = timeline.stage_times(vdp.cluster.kubectl("logs", head, "-n", vdp.ns, "-c",
                                                    "ray-head").stdout, st["headJob"])
    assert "answered" in said and said["answered"] <= switched, (said, switched)
    # A new generation: its Ray nodes joined as the first launch's did (a third p5 sample).
    LAUNCHES.append(launch_of(vdp, "Surge: the new generation", applied, joined=True,
                              routed_on_health=False))  # fmt: skip
    models = http(f"{url}/v1/models", headers=AUTH)
    assert models["data"][0]["max_model_len"] == 192, models
    assert completion(url, http)["object"] == "text_completion"


def test_surge_to_a_new_port_with_no_failed_request(vdp: Vdp) -> None:
    """Issue 38 item 2 on real vLLM CPU engines (D2, after D): a Surge that changes
    `spec.service.port` alone. The old generation keeps its port in the Service, the slice
    and the NetworkPolicy until the new one answers a completion; a client on the old port
    loses nothing sent before the switch, a client on the new port that starts once
    kube-proxy has it loses nothing, and each port moves once (portsurge.py, which the
    engine double's C2 shares). A port change ends the old port's kept connections with it,
    so the kept-alive client of the drain is D's, on an unchanged port."""
    vdp.wait_phase("Serving", 600)
    old_port = service_port(vdp)
    assert old_port != NEW_PORT
    doc = example(vdp.ns, max_model_len=192)  # D's engines: the port is the only change
    doc["spec"]["update"] = {"strategy": "Surge", "drainSeconds": 10}
    doc["spec"]["service"] = {**doc["spec"].get("service", {}), "port": NEW_PORT}
    doc["spec"].setdefault("launch", {})["timeoutSeconds"] = 1200  # as D's: a boot beside

    def client(url: str, name: str, wait_go: bool) -> Traffic:
        return Traffic(vdp.cluster, vdp.ns, url, "tiny", f"{IMAGE}:dev", name=name, rate=10,
                       api_key_secret=("api-key", "key"), wait_go=wait_go)  # fmt: skip

    run = surge_to_new_port(vdp, doc, old_port, NEW_PORT, client, switch_s=1260,
                            drain_s=180, label="d2")  # fmt: skip
    FAULTS.update(run.lines("D2 Surge to a new port"))
    run.check()
    assert service_port(vdp) == NEW_PORT
    url = f"http://{vdp.service_ip()}:{NEW_PORT}"
    assert http(f"{url}/v1/models", headers=AUTH)["data"][0]["max_model_len"] == 192
    assert completion(url, http)["object"] == "text_completion"


#: Run in the head pod by the floor's Ray job: say when, then exec the launcher's exact
#: `vllm serve` command with its environment (what `--dry-run` prints).
_EXEC_BY_HAND = ("import json,os,sys,time;cmd=json.loads(sys.argv[1]);"
                 "env={**os.environ,**json.loads(sys.argv[2])};"
                 "print('floor-exec-at',repr(time.time()),flush=True);"
                 "os.execvpe(cmd[0],cmd,env)")  # fmt: skip


def bare_pod(head: dict[str, Any], name: str) -> dict[str, Any]:
    """A pod of the engine image on the head's node, with no KubeRay, no Ray and no request
    (the node's CPUs are the head's), restricted as the Ray pods are."""
    c0 = head["spec"]["containers"][0]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": head["metadata"]["namespace"]},
            "spec": {"nodeName": head["spec"]["nodeName"], "restartPolicy": "Never",
                     "automountServiceAccountToken": False,
                     "securityContext": head["spec"]["securityContext"],
                     "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "bare", "image": c0["image"],
                                     "imagePullPolicy": "Never", "command": ["sleep", "3600"],
                                     "env": [{"name": "RAY_AUTH_MODE", "value": "disabled"}],
                                     "securityContext": c0["securityContext"]}]}}  # fmt: skip


@pytest.mark.floor
def test_p5_floor_of_each_step_by_hand(vdp: Vdp) -> None:
    """Issue 22's per-step floors, measured directly in the same image and pods, with the
    operator scaled to 0 and the serving Ray job stopped (so nothing shares the CPUs):
    - apply → pods running: a bare pod of the image on the head's node, created → running;
    - → Ray joined: `ray start --head` by hand in that pod, exec → returned (node registered);
    - → first healthy: the launcher's exact `vllm serve` command and environment (its
      --dry-run in the head pod), run by hand in the head pod as a Ray job, exec → the first
      200 on /health (polled from the host every 0.1 s).
    The operator comes back at the end; the resource is deleted by the next test."""
    cluster, ns = vdp.cluster, vdp.ns
    st = vdp.wait_phase("Serving", 600)
    job = vdp.rayjob(st["headJob"])
    assert job is not None
    sid, env = job["status"]["jobId"], json.loads(job["spec"]["runtimeEnvYAML"])
    head = vdp.pods()["head"]
    head_name, head_ip = head["metadata"]["name"], head["status"]["podIP"]
    plan_b64 = job["spec"]["entrypoint"].split("--plan-b64", 1)[1].split()[0]
    dry = json.loads(cluster.exec(ns, head_name, "python", "-m", "vllm_dp_launcher",
                                  "--plan-b64", plan_b64, "--dry-run", "--node-ip",
                                  head_ip).stdout)  # fmt: skip
    assert dry["command"][:2] == ["vllm", "serve"], dry["command"]
    [deploy] = cluster.kubectl("get", "deploy", "-n", OPERATOR_NS, "-l", OPERATOR_LABEL,
                               "-o", "name").stdout.split()  # fmt: skip
    replicas = int(cluster.kubectl_json("get", deploy, "-n", OPERATOR_NS)["spec"]["replicas"])
    jobs = vdp.dashboard_url("/api/jobs/")
    port = service_port(vdp)
    health = f"http://{head_ip}:{port}/health"
    by_hand = f"floor-vllm-{int(time.time())}"
    bare = "floor-bare"
    cluster.kubectl("scale", deploy, "-n", OPERATOR_NS, "--replicas=0")
    try:
        vdp.wait("no operator pod", lambda: not cluster.kubectl(
            "get", "pods", "-n", OPERATOR_NS, "-l", OPERATOR_LABEL, "-o", "name").stdout.strip(),
            120)  # fmt: skip
        http(f"{jobs}{sid}/stop", {}, timeout=30, headers=vdp.ray_headers())
        vdp.wait("the serving Ray job stopped", lambda: vdp.dashboard_jobs()[sid]["status"] in (
            "STOPPED", "FAILED", "SUCCEEDED"), 120)  # fmt: skip
        vdp.wait("the engines gone", lambda: http_status_or_none(health) is None, 120)
        vdp.wait("Ray's placement groups released", lambda: not [
            pg for pg in http(vdp.dashboard_url("/api/v0/placement_groups?detail=1&limit=100"),
                              timeout=10, headers=vdp.ray_headers())["data"]["result"]["result"]
            if pg.get("state") != "REMOVED"], 120)  # fmt: skip

        # apply → pods running: a bare pod of the same image on the same node.
        cluster.apply(bare_pod(head, bare))

        def running() -> dict[str, Any] | None:
            pod: dict[str, Any] = cluster.kubectl_json("get", "pod", bare, "-n", ns)
            return pod if (pod.get("status") or {}).get("phase") == "Running" else None

        pod = vdp.wait("the bare pod running", running, 120)
        BY_HAND["pods running"] = (timeline.started_at([pod]) - timeline.created_at(pod)) * 1000
        # → Ray joined: a Ray head started by hand in it (`ray start` returns once its node is
        # registered with its GCS).
        timed = cluster.exec(ns, bare, "python3", "-c", (
            "import subprocess,time;t=time.time();subprocess.run(['ray','start','--head',"
            "'--port=6390','--num-cpus=1','--num-gpus=0','--disable-usage-stats',"
            "'--include-dashboard=false'],check=True,capture_output=True);"
            "print(time.time()-t)"))  # fmt: skip
        BY_HAND["Ray joined"] = float(timed.stdout.split()[-1]) * 1000

        # → first healthy: the launcher's vllm serve, by hand in the head pod.
        entry = shlex.join(["python", "-c", _EXEC_BY_HAND, json.dumps(dry["command"]),
                            json.dumps(dry["env"])])  # fmt: skip
        http(jobs, {"entrypoint": entry, "submission_id": by_hand, "runtime_env": env},
             timeout=30, headers=vdp.ray_headers())  # fmt: skip
        vdp.wait("vLLM by hand answering /health", lambda: http_status_or_none(health) == 200,
                 600, interval=0.1)  # fmt: skip
        healthy = time.time()
        logs = vdp.job_logs(by_hand)
        said = re.search(r"floor-exec-at (\d+\.\d+)", logs)
        assert said, logs[-3000:]
        BY_HAND["first healthy"] = (healthy - float(said[1])) * 1000
        assert completion(f"http://{head_ip}:{port}", http)["object"] == "text_completion"
        note(f"floors by hand: {BY_HAND}")
    finally:
        try:
            with contextlib.suppress(OSError):
                if by_hand in vdp.dashboard_jobs():
                    http(f"{jobs}{by_hand}/stop", {}, timeout=30, headers=vdp.ray_headers())
            cluster.kubectl("delete", "pod", bare, "-n", ns, "--ignore-not-found",
                            "--wait=true", check=False, timeout=120)  # fmt: skip
        finally:
            cluster.kubectl("scale", deploy, "-n", OPERATOR_NS, f"--replicas={replicas}")
    assert set(BY_HAND) == {"pods running", "Ray joined", "first healthy"}


def service_port(vdp: Vdp) -> int:
    """The API Service's port now (a Surge may have moved it)."""
    svc = vdp.cluster.kubectl_json("get", "service", f"{vdp.name}-api", "-n", vdp.ns)
    return int(svc["spec"]["ports"][0]["port"])


def http_status_or_none(url: str) -> int | None:
    """The status of a GET from the host, or None when nothing answers."""
    try:
        return http_status(url)
    except (OSError, TimeoutError):
        return None


def test_delete_removes_everything(vdp: Vdp) -> None:
    assert vdp.token_secrets(), "the resource's Ray token Secrets, found by their labels"
    t0 = time.monotonic()
    vdp.cluster.kubectl("delete", "vdp", vdp.name, "-n", vdp.ns, "--wait=true", timeout=120)
    vdp.wait("every child gone", lambda: vdp.children() == [], 180)
    # The token Secret went with its owner too (the API key's Secret is the user's: it stays).
    vdp.wait("the Ray token Secrets gone", lambda: vdp.token_secrets() == [], 60)
    note(f"delete: every child gone in {time.monotonic() - t0:.0f}s")
