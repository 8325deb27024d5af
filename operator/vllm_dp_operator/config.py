"""Operator settings, read once from the environment."""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field

from vllm_dp_operator import constants
from vllm_dp_operator.engines.ray_auth import RayTokens


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return float(raw) if raw else default


def _namespaces(value: str | None) -> tuple[str, ...]:
    """A comma-separated list of namespaces, in order, without blanks or repeats."""
    out: list[str] = []
    for name in (value or "").split(","):
        if name.strip() and name.strip() not in out:
            out.append(name.strip())
    return tuple(out)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return int(raw) if raw else default


# A DNS subdomain: dot-separated labels of lowercase letters, digits and inner hyphens.
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def cluster_domain(raw: str | None) -> str:
    """VLLMDP_CLUSTER_DOMAIN as a DNS name without its trailing dot; the default when unset."""
    domain = (raw or "").strip().rstrip(".") or constants.DEFAULT_CLUSTER_DOMAIN
    if len(domain) > 253 or not _DNS_SUBDOMAIN.match(domain):
        raise ValueError(
            f"VLLMDP_CLUSTER_DOMAIN={raw!r}: expected a DNS name of lowercase letters, digits, "
            "'-' and '.', such as cluster.local (the kubelet's --cluster-domain)"
        )
    return domain


METRICS_AUTHS = ("kubernetes", "none")


def _csv(raw: str | None) -> tuple[str, ...]:
    """A comma-separated list, blanks dropped."""
    return tuple(part.strip() for part in (raw or "").split(",") if part.strip())


def _metrics_auth(raw: str | None) -> str:
    value = (raw or "kubernetes").strip()
    if value not in METRICS_AUTHS:
        raise ValueError(f"VLLMDP_METRICS_AUTH={raw!r}: expected one of {', '.join(METRICS_AUTHS)}")
    return value


def _tls_pair() -> tuple[str, str]:
    """The metrics certificate and key files: both or neither."""
    cert = (os.environ.get("VLLMDP_METRICS_TLS_CERT_FILE") or "").strip()
    key = (os.environ.get("VLLMDP_METRICS_TLS_KEY_FILE") or "").strip()
    if bool(cert) != bool(key):
        raise ValueError("VLLMDP_METRICS_TLS_CERT_FILE and VLLMDP_METRICS_TLS_KEY_FILE: set both "
                         "(HTTPS) or neither (HTTP)")  # fmt: skip
    return cert, key


def _env_bool(name: str, default: bool) -> bool:
    raw = (os.environ.get(name) or "").strip().lower()
    if not raw:
        return default
    if raw in ("true", "1", "yes"):
        return True
    if raw in ("false", "0", "no"):
        return False
    raise ValueError(f"{name}: expected true or false, got {raw!r}")


@dataclass(frozen=True)
class LeaderElection:
    """Leader election on a coordination.k8s.io/v1 Lease (controller-runtime's defaults)."""

    #: VLLMDP_LEADER_ELECTION: only the Lease's holder writes; off only for a lone process.
    enabled: bool = True
    #: VLLMDP_LEASE_NAME: the Lease's name.
    lease_name: str = "vllm-dp-operator"
    #: VLLMDP_LEASE_NAMESPACE, else POD_NAMESPACE (the chart: the release namespace).
    lease_namespace: str = "default"
    #: VLLMDP_LEASE_DURATION_SECONDS: how long a standby waits, from when it last saw the
    #: record change, before it takes a Lease that was not renewed.
    lease_duration_seconds: float = 15.0
    #: VLLMDP_RENEW_DEADLINE_SECONDS: the leader stops writing, and exits, when it has not
    #: renewed for this long; shorter than the lease, so it stops before anyone takes over.
    renew_deadline_seconds: float = 10.0
    #: VLLMDP_RETRY_PERIOD_SECONDS: how often the leader renews and a standby asks.
    retry_period_seconds: float = 2.0
    #: POD_NAME (the downward API), else the host name: the first part of the identity.
    pod_name: str = "operator"

    def check(self) -> None:
        """Raise naming the settings when the timings cannot keep the Lease safe."""
        if not 0 < self.retry_period_seconds < self.renew_deadline_seconds \
                < self.lease_duration_seconds:  # fmt: skip
            raise ValueError(
                "VLLMDP_RETRY_PERIOD_SECONDS < VLLMDP_RENEW_DEADLINE_SECONDS < "
                "VLLMDP_LEASE_DURATION_SECONDS must hold, got "
                f"{self.retry_period_seconds:g} < {self.renew_deadline_seconds:g} < "
                f"{self.lease_duration_seconds:g}"
            )

    @classmethod
    def from_env(cls) -> LeaderElection:
        """Read the leader-election settings from the process environment."""
        election = cls(
            enabled=_env_bool("VLLMDP_LEADER_ELECTION", True),
            lease_name=os.environ.get("VLLMDP_LEASE_NAME") or "vllm-dp-operator",
            lease_namespace=(os.environ.get("VLLMDP_LEASE_NAMESPACE")
                             or os.environ.get("POD_NAMESPACE") or "default"),
            lease_duration_seconds=_env_float("VLLMDP_LEASE_DURATION_SECONDS", 15.0),
            renew_deadline_seconds=_env_float("VLLMDP_RENEW_DEADLINE_SECONDS", 10.0),
            retry_period_seconds=_env_float("VLLMDP_RETRY_PERIOD_SECONDS", 2.0),
            pod_name=os.environ.get("POD_NAME") or socket.gethostname(),
        )
        election.check()
        return election


Labels = tuple[tuple[str, str], ...]


def parse_labels(name: str, raw: str | None) -> Labels:
    """`k=v,k2=v2` (an env variable's form) as sorted pairs; raise naming the variable."""
    pairs = []
    for item in (raw or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.strip().partition("=")
        if not sep or not key:
            raise ValueError(f"{name}={raw!r}: expected key=value pairs separated by commas")
        pairs.append((key.strip(), value.strip()))
    return tuple(sorted(pairs))


@dataclass(frozen=True)
class PolicyPeers:
    """Who, besides a Ray cluster's own pods, the rendered NetworkPolicy admits: the operator
    (the dashboard and the API port, for its job calls and /health probes) and KubeRay (the
    dashboard: it submits and polls the head job there)."""

    #: VLLMDP_NETWORK_POLICY: render a NetworkPolicy for each resource that asks for one.
    enabled: bool = True
    #: VLLMDP_OPERATOR_NAMESPACE (else POD_NAMESPACE): the operator pods' namespace; "" (the
    #: operator outside the cluster) admits no operator pod.
    operator_namespace: str = ""
    #: VLLMDP_OPERATOR_POD_LABELS: the operator pods' labels, `k=v,...` (the chart's selector).
    operator_pod_labels: Labels = ()
    #: VLLMDP_OPERATOR_CIDRS: address blocks admitted like the operator's pods, for an operator
    #: outside the pod network (apiserver-proxy mode: the API servers' addresses).
    operator_cidrs: tuple[str, ...] = ()
    #: VLLMDP_KUBERAY_NAMESPACE: KubeRay's namespace; "" for the operator's own.
    kuberay_namespace: str = ""
    #: VLLMDP_KUBERAY_POD_LABELS: KubeRay's operator pods' labels (its chart's default).
    kuberay_pod_labels: Labels = (("app.kubernetes.io/name", "kuberay-operator"),)
    #: Who reaches the API port of a resource that sets no spec.service.allowFrom: its own
    #: namespace's pods and every pod of the namespaces carrying all of these labels
    #: (VLLMDP_API_NAMESPACE_LABELS, `k=v,...`; empty: no other namespace) ...
    api_namespace_labels: Labels = ((constants.LABEL_API_ACCESS, "true"),)
    #: ... or every pod of the cluster (VLLMDP_API_PORT_OPEN: the earlier default).
    api_open: bool = False

    @classmethod
    def from_env(cls) -> PolicyPeers:
        """Read the NetworkPolicy peers from the process environment."""
        default = cls()
        kuberay_labels = os.environ.get("VLLMDP_KUBERAY_POD_LABELS")
        api_labels = os.environ.get("VLLMDP_API_NAMESPACE_LABELS")
        return cls(
            enabled=_env_bool("VLLMDP_NETWORK_POLICY", True),
            operator_namespace=(os.environ.get("VLLMDP_OPERATOR_NAMESPACE")
                                or os.environ.get("POD_NAMESPACE") or ""),
            operator_pod_labels=parse_labels("VLLMDP_OPERATOR_POD_LABELS",
                                             os.environ.get("VLLMDP_OPERATOR_POD_LABELS")),
            operator_cidrs=tuple(c.strip() for c in
                                 (os.environ.get("VLLMDP_OPERATOR_CIDRS") or "").split(",")
                                 if c.strip()),
            kuberay_namespace=os.environ.get("VLLMDP_KUBERAY_NAMESPACE") or "",
            kuberay_pod_labels=(parse_labels("VLLMDP_KUBERAY_POD_LABELS", kuberay_labels)
                                if kuberay_labels else default.kuberay_pod_labels),
            api_namespace_labels=(parse_labels("VLLMDP_API_NAMESPACE_LABELS", api_labels)
                                  if api_labels is not None else default.api_namespace_labels),
            api_open=_env_bool("VLLMDP_API_PORT_OPEN", False),
        )  # fmt: skip


@dataclass(frozen=True)
class RenderOptions:
    """Operator-wide inputs of the renderers (kept apart so renderers never read env)."""

    #: Engine image used when a resource names none.
    default_image: str = "vllm-dp-engine:0.1.0"
    #: Ray version the engine image carries; written to RayCluster.spec.rayVersion.
    ray_version: str = constants.RAY_VERSION
    #: NIC that Gloo and NCCL bind to in every pod (vllm#5094, vllm#7074).
    socket_ifname: str = "eth0"
    #: fsGroup of every Ray pod, so the non-root engine can write the model cache claim.
    fs_group: int = 2000
    #: The NetworkPolicy's switch and its peers besides the Ray pods (VLLMDP_NETWORK_POLICY,
    #: VLLMDP_OPERATOR_*, VLLMDP_KUBERAY_*).
    peers: PolicyPeers = field(default_factory=PolicyPeers)


def update_limit(raw: str | None, default: str = "10%") -> tuple[int, float]:
    """`N` (at most N resources; 0: no bound) or `P%` (P percent of the resources, at least
    one): returned as (count, fraction), one of them 0."""
    text = (raw or default).strip()
    try:
        if text.endswith("%"):
            pct = float(text[:-1])
            if not 0 < pct <= 100:
                raise ValueError
            return 0, pct / 100
        count = int(text)
        if count < 0:
            raise ValueError
        return count, 0.0
    except ValueError:
        raise ValueError(f"VLLMDP_MAX_CONCURRENT_UPDATES={raw!r}: expected a whole number "
                         "(0: no bound) or a percentage such as 10%") from None


def _update_limit(raw: str | None) -> str:
    update_limit(raw)  # refused here, at start, not at the first update
    return (raw or "10%").strip()


@dataclass(frozen=True)
class Config:
    """Every setting of the operator process, each from one VLLMDP_* variable."""

    #: Renderer inputs: VLLMDP_ENGINE_IMAGE, VLLMDP_SOCKET_IFNAME, VLLMDP_ENGINE_FS_GROUP.
    render: RenderOptions = field(default_factory=RenderOptions)
    #: VLLMDP_HEALTH_PROBE: how the operator reaches vLLM's /health and the Ray dashboard on
    #: the head pod: service-dns (in cluster), apiserver-proxy (outside), or off.
    health_probe: str = "service-dns"
    #: VLLMDP_CLUSTER_DOMAIN: the cluster's DNS domain (the kubelet's --cluster-domain). The
    #: service-dns probe calls <service>.<namespace>.svc.<domain>. as an absolute name, so no
    #: lookup goes through the search path first.
    cluster_domain: str = constants.DEFAULT_CLUSTER_DOMAIN
    #: VLLMDP_RESYNC_SECONDS: safety net: how often each resource is reconciled when no
    #: event and no probe woke it (children's changes wake it at once through the watches).
    resync_seconds: float = 600.0
    #: VLLMDP_PROBE_LAUNCHING_SECONDS: /health probe period while an engine is Launching.
    probe_launching_seconds: float = 5.0
    #: VLLMDP_PROBE_SERVING_SECONDS: /health probe period while Serving (+-10% jitter): an
    #: engine that stops answering is noticed within 1.1 x this + the probe timeout.
    probe_serving_seconds: float = 30.0
    #: VLLMDP_PROBE_METRICS_SECONDS: /metrics is read with a probe's ok /health at most about
    #: this often (and with the first ok answer after a failure); 0: with every ok /health.
    probe_metrics_seconds: float = 60.0
    #: VLLMDP_UNROUTE_AFTER_FAILURES and VLLMDP_UNROUTE_AFTER_SECONDS: a head job that has
    #: served stops being routed on the operator's word alone only after this many failed
    #: probes in a row, spanning at least this long. The operator failing to ask (a timeout,
    #: a DNS or network blink, its own busy loop) is no evidence that the engine is gone; a
    #: dead engine ends its head job, which stops routing at once without any probe.
    unroute_after_failures: int = 3
    unroute_after_seconds: float = 90.0
    #: VLLMDP_RELAUNCH_HUNG_AFTER_SECONDS: a head job that served and whose probes have failed
    #: in a row (past the unroute threshold) for this long is taken as hung: stopped and
    #: relaunched, counted as a failure, so its GPUs do not stay held by an engine that no
    #: longer serves. 0: never (it stays unrouted until its head job ends).
    relaunch_hung_after_seconds: float = 300.0
    #: VLLMDP_MAX_CONCURRENT_UPDATES: most resources whose serving replicas update at once
    #: (a spec change or a restart), `N` or `P%` of the resources (at least one); 0: no bound.
    #: The rest serve what they run, UpdatePending (controller/update_slots.py).
    max_concurrent_updates: str = "10%"
    #: VLLMDP_WORKERS: resources reconciled at once (each resource by one worker at a time).
    workers: int = 16
    #: VLLMDP_PROBE_CONCURRENCY: most engines probed at once, in the probe pool (never in a
    #: reconcile worker): a hung engine holds one slot for at most the probe timeout.
    probe_concurrency: int = 32
    #: VLLMDP_PROXY_QPS: with VLLMDP_HEALTH_PROBE=apiserver-proxy, the most probe and Ray job
    #: requests a second sent through the API server (a burst of twice that); 0: no limit.
    proxy_qps: float = 20.0
    #: VLLMDP_WATCH_NAMESPACES: the namespaces whose children are watched, comma-separated;
    #: empty for all. Must match kopf's --namespace flags (the chart sets both from
    #: watchNamespaces).
    watch_namespaces: tuple[str, ...] = ()
    #: VLLMDP_BACKOFF_BASE_SECONDS: wait after the first head-job failure; doubles after each.
    backoff_base_seconds: float = 10.0
    #: VLLMDP_BACKOFF_CAP_SECONDS: longest wait between head-job relaunches.
    backoff_cap_seconds: float = 300.0
    #: VLLMDP_HEALTH_TIMEOUT_SECONDS: timeout of one /health probe or Ray job API call.
    health_timeout_seconds: float = 2.0
    #: VLLMDP_STOP_CONFIRM_SECONDS: how long the operator tries to confirm that a stopped Ray
    #: job has ended (after its drain grace, when the stop was delivered) before it goes ahead
    #: with a Warning event.
    stop_confirm_seconds: float = 60.0
    #: VLLMDP_METRICS_PORT: port of the operator's Prometheus /metrics; 0 serves none.
    metrics_port: int = 0
    #: VLLMDP_METRICS_HOST: address the metrics server binds (the chart: all interfaces).
    metrics_host: str = "0.0.0.0"
    #: VLLMDP_METRICS_AUTH: "kubernetes": a scrape needs a bearer token that passes a
    #: TokenReview and a SubjectAccessReview for get on /metrics; "none": anyone who reaches
    #: the port may read it.
    metrics_auth: str = "kubernetes"
    #: VLLMDP_METRICS_AUDIENCES: comma-separated audiences a scraper's token must be issued
    #: for (TokenReview's spec.audiences); empty: the API server's own.
    metrics_audiences: tuple[str, ...] = ()
    #: VLLMDP_METRICS_TLS_CERT_FILE, VLLMDP_METRICS_TLS_KEY_FILE: the metrics server's
    #: certificate and key (PEM); both set serves HTTPS, neither plain HTTP.
    metrics_tls_cert_file: str = ""
    metrics_tls_key_file: str = ""
    #: VLLMDP_ENGINE_METRICS_MAX_BYTES: most bytes of vLLM's /metrics read per probe while
    #: Serving (status.load, the vllmdp_engine_* gauges); the rest of a longer answer is not read.
    engine_metrics_max_bytes: int = 4 * 1024 * 1024
    #: Leader election: VLLMDP_LEADER_ELECTION, VLLMDP_LEASE_*, VLLMDP_RENEW_DEADLINE_SECONDS,
    #: VLLMDP_RETRY_PERIOD_SECONDS, POD_NAME, POD_NAMESPACE.
    election: LeaderElection = field(default_factory=LeaderElection)
    #: VLLMDP_READINESS_PORT: port of GET /readyz (200: caches synced and the Lease API
    #: answers, so this process leads or could); 0 serves none.
    readiness_port: int = 8082
    #: VLLMDP_READINESS_HOST: address the readiness server binds (the chart: all interfaces).
    readiness_host: str = "0.0.0.0"
    #: VLLMDP_RAY_AUTH_KEY_FILE: a file holding the operator's Ray auth key (the chart mounts
    #: a Secret of the release namespace). Each resource's Ray token is derived from it, so
    #: every replica and every restart computes the same tokens without reading a Secret.
    #: Unset: a random key for this process only (a lone process for development).
    #: VLLMDP_RAY_AUTH_PREVIOUS_KEY_FILE: the key before a rotation, while clusters made with
    #: it still run; a missing file means none.
    ray_tokens: RayTokens = field(default_factory=RayTokens.random)

    @classmethod
    def from_env(cls) -> Config:
        """Read the settings from the process environment."""
        defaults = RenderOptions()
        return cls(
            render=RenderOptions(
                default_image=os.environ.get("VLLMDP_ENGINE_IMAGE") or defaults.default_image,
                socket_ifname=os.environ.get("VLLMDP_SOCKET_IFNAME") or defaults.socket_ifname,
                fs_group=int(os.environ.get("VLLMDP_ENGINE_FS_GROUP") or defaults.fs_group),
                peers=PolicyPeers.from_env(),
            ),
            health_probe=os.environ.get("VLLMDP_HEALTH_PROBE") or "service-dns",
            cluster_domain=cluster_domain(os.environ.get("VLLMDP_CLUSTER_DOMAIN")),
            resync_seconds=_env_float("VLLMDP_RESYNC_SECONDS", 600.0),
            probe_launching_seconds=_env_float("VLLMDP_PROBE_LAUNCHING_SECONDS", 5.0),
            probe_serving_seconds=_env_float("VLLMDP_PROBE_SERVING_SECONDS", 30.0),
            probe_metrics_seconds=_env_float("VLLMDP_PROBE_METRICS_SECONDS", 60.0),
            unroute_after_failures=_env_int("VLLMDP_UNROUTE_AFTER_FAILURES", 3),
            unroute_after_seconds=_env_float("VLLMDP_UNROUTE_AFTER_SECONDS", 90.0),
            relaunch_hung_after_seconds=_env_float("VLLMDP_RELAUNCH_HUNG_AFTER_SECONDS", 300.0),
            max_concurrent_updates=_update_limit(os.environ.get("VLLMDP_MAX_CONCURRENT_UPDATES")),
            workers=_env_int("VLLMDP_WORKERS", 16),
            probe_concurrency=_env_int("VLLMDP_PROBE_CONCURRENCY", 32),
            proxy_qps=_env_float("VLLMDP_PROXY_QPS", 20.0),
            watch_namespaces=_namespaces(os.environ.get("VLLMDP_WATCH_NAMESPACES")),
            backoff_base_seconds=_env_float("VLLMDP_BACKOFF_BASE_SECONDS", 10.0),
            backoff_cap_seconds=_env_float("VLLMDP_BACKOFF_CAP_SECONDS", 300.0),
            health_timeout_seconds=_env_float("VLLMDP_HEALTH_TIMEOUT_SECONDS", 2.0),
            stop_confirm_seconds=_env_float("VLLMDP_STOP_CONFIRM_SECONDS", 60.0),
            metrics_port=_env_int("VLLMDP_METRICS_PORT", 0),
            metrics_host=os.environ.get("VLLMDP_METRICS_HOST") or "0.0.0.0",
            metrics_auth=_metrics_auth(os.environ.get("VLLMDP_METRICS_AUTH")),
            metrics_audiences=_csv(os.environ.get("VLLMDP_METRICS_AUDIENCES")),
            metrics_tls_cert_file=_tls_pair()[0],
            metrics_tls_key_file=_tls_pair()[1],
            engine_metrics_max_bytes=_env_int("VLLMDP_ENGINE_METRICS_MAX_BYTES", 4 * 1024 * 1024),
            election=LeaderElection.from_env(),
            readiness_port=_env_int("VLLMDP_READINESS_PORT", 8082),
            readiness_host=os.environ.get("VLLMDP_READINESS_HOST") or "0.0.0.0",
            ray_tokens=RayTokens.from_file(
                os.environ.get("VLLMDP_RAY_AUTH_KEY_FILE") or "",
                os.environ.get("VLLMDP_RAY_AUTH_PREVIOUS_KEY_FILE") or ""),
        )

    def backoff(self, consecutive_failures: int) -> float:
        """Seconds to wait before relaunching after this many failures in a row."""
        if consecutive_failures <= 0:
            return 0.0
        return min(self.backoff_base_seconds * 2.0 ** (consecutive_failures - 1),
                   self.backoff_cap_seconds)
