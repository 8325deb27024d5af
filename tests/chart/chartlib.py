"""Render the operator's Helm chart and read its RBAC; shared by the chart, control-plane and
kind tiers (they load this file by path: the test folders are not packages).

The chart has no dependencies (KubeRay is installed with its own chart), so helm renders and
installs the checked-out directory as it is: what the README's `helm install` line does.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "vllm-dp-operator"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
ENSURE_HELM = REPO / "tests" / "chart" / "ensure_helm.sh"
DEFAULT_RELEASE = "vdp"
DEFAULT_NAMESPACE = "vllm-dp-system"


class HelmUnavailable(RuntimeError):
    """The helm binary could not be found or built."""


def helm_binary() -> str:
    """Path to helm: $VLLMDP_HELM if set, else the cached build from ensure_helm.sh."""
    override = os.environ.get("VLLMDP_HELM")
    if override:
        return override
    try:
        proc = subprocess.run(
            ["bash", str(ENSURE_HELM)], capture_output=True, text=True, timeout=1800, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HelmUnavailable(f"{ENSURE_HELM} did not run: {exc}") from exc
    if proc.returncode != 0:
        raise HelmUnavailable(
            f"{ENSURE_HELM} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    return proc.stdout.strip().splitlines()[-1]


def helm(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run helm; raise AssertionError with its output on failure when `check`."""
    proc = subprocess.run(
        [helm_binary(), *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed (rc={proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


def template_args(
    values_files: Sequence[Path] = (),
    set_values: Sequence[str] = (),
    release: str = DEFAULT_RELEASE,
    namespace: str = DEFAULT_NAMESPACE,
) -> list[str]:
    """Arguments after `helm template` / `helm install` for a chart, values and release."""
    args = [release, str(CHART), f"--namespace={namespace}"]
    args += [f"--values={p}" for p in values_files]
    args += [f"--set={s}" for s in set_values]
    return args


#: What a Kubernetes 1.30+ API server serves and helm's defaults lack.
VAP_API = "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy"


def render(
    values_files: Sequence[Path] = (),
    set_values: Sequence[str] = (),
    release: str = DEFAULT_RELEASE,
    namespace: str = DEFAULT_NAMESPACE,
    include_crds: bool = False,
    api_versions: Sequence[str] = (VAP_API,),
) -> list[dict[str, Any]]:
    """`helm template` the chart and return its objects (CRDs only when asked), as for a
    cluster that serves `api_versions` besides helm's defaults (by default, Kubernetes 1.30+'s
    ValidatingAdmissionPolicy)."""
    extra = ["--include-crds"] if include_crds else []
    extra += [f"--api-versions={v}" for v in api_versions]
    out = helm("template", *template_args(values_files, set_values, release, namespace), *extra)
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def by_kind(objects: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o.get("kind") == kind]


# --- RBAC --------------------------------------------------------------------------------

RBAC_KINDS = ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ServiceAccount")
#: The admission policy that fences the ServiceAccount, and its binding.
FENCE_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


@dataclass(frozen=True)
class Grant:
    """One (apiGroup, resource, verb) a rendered Role/ClusterRole allows, and where."""

    group: str
    resource: str
    verb: str
    kind: str  # "ClusterRole" or "Role"
    namespace: str | None  # the Role's namespace; None for a ClusterRole


def grants(objects: Iterable[dict[str, Any]]) -> set[Grant]:
    """Expand every rule of every rendered Role/ClusterRole that a rendered binding grants
    into single grants (a role the chart only offers, for others to bind, grants nothing)."""
    objects = list(objects)
    bound = {(b["roleRef"]["kind"], b["roleRef"]["name"]) for b in objects
             if b.get("kind") in ("ClusterRoleBinding", "RoleBinding")}  # fmt: skip
    out: set[Grant] = set()
    for obj in objects:
        if obj.get("kind") not in ("ClusterRole", "Role"):
            continue
        if (obj["kind"], obj["metadata"]["name"]) not in bound:
            continue
        ns = obj["metadata"].get("namespace") if obj["kind"] == "Role" else None
        for rule in obj.get("rules") or []:
            assert not rule.get("nonResourceURLs"), f"nonResourceURLs granted: {rule}"
            assert not rule.get("resourceNames"), f"resourceNames are not expected: {rule}"
            for group in rule.get("apiGroups") or []:
                for resource in rule.get("resources") or []:
                    for verb in rule.get("verbs") or []:
                        out.add(Grant(group, resource, verb, obj["kind"], ns))
    return out


def rbac_objects(objects: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ServiceAccount, roles and bindings among rendered objects."""
    return [o for o in objects if o.get("kind") in RBAC_KINDS]


def sa_kubeconfig(path: Path, admin_kubeconfig: Path, token: str, name: str = "operator") -> Path:
    """Write a kubeconfig that reaches the same cluster as `admin_kubeconfig` (its current
    context's server and CA) but authenticates with a ServiceAccount token; return its path.
    Used to run kubectl, or the operator itself, with exactly the chart's permissions."""
    admin = yaml.safe_load(Path(admin_kubeconfig).read_text())
    current = admin.get("current-context")
    contexts = {c["name"]: c["context"] for c in admin.get("contexts") or []}
    cluster_name = (
        contexts[current]["cluster"] if current in contexts else admin["clusters"][0]["name"]
    )
    cluster = next(c["cluster"] for c in admin["clusters"] if c["name"] == cluster_name)
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": dict(cluster)}],
        "users": [{"name": name, "user": {"token": token}}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
        "current-context": name,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path


# --- Applying the chart's identity to a real cluster (control-plane and kind tiers) ------

Kubectl = Callable[..., "subprocess.CompletedProcess[str]"]


@dataclass(frozen=True)
class OperatorIdentity:
    """The chart's ServiceAccount and RBAC, applied to a cluster."""

    release: str
    namespace: str  # release namespace: where the ServiceAccount lives
    service_account: str
    objects: tuple[dict[str, Any], ...]

    @property
    def username(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.service_account}"


def privileged_raycluster(image: str, namespace: str = "kube-system") -> dict[str, Any]:
    """A RayCluster the chart's fence must refuse the operator: no VLLMDataParallel owner,
    a privileged container on the host network with the node's root mounted."""
    pod = {"containers": [{"name": "ray-head", "image": image,
                           "securityContext": {"privileged": True}}],
           "hostNetwork": True, "volumes": [{"name": "root", "hostPath": {"path": "/"}}]}
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster",
            "metadata": {"name": "stolen", "namespace": namespace,
                         "labels": {"app.kubernetes.io/managed-by": "vllm-dp-operator"}},
            "spec": {"headGroupSpec": {"rayStartParams": {}, "template": {"spec": pod}}}}


def apply_operator_identity(
    kubectl: Kubectl,
    release: str,
    namespace: str,
    values_files: Sequence[Path] = (),
    set_values: Sequence[str] = (),
) -> OperatorIdentity:
    """Render the chart and apply only its ServiceAccount, Roles and bindings, and the
    admission policy that fences the ServiceAccount.

    `kubectl(*args, input=...)` runs kubectl as an administrator (e.g. `testbed.kubectl`).
    """
    rendered = render(values_files, set_values, release, namespace)
    objects = rbac_objects(rendered) + [o for o in rendered if o.get("kind") in FENCE_KINDS
                                        and o["metadata"]["name"].endswith("-fence")]
    (sa,) = by_kind(objects, "ServiceAccount")
    kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objects))
    return OperatorIdentity(release, namespace, sa["metadata"]["name"], tuple(objects))


def delete_operator_identity(kubectl: Kubectl, identity: OperatorIdentity) -> None:
    """Delete what apply_operator_identity created (cluster-scoped objects included)."""
    kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-",
            input=yaml.safe_dump_all(list(identity.objects)))


def operator_kubeconfig(
    kubectl: Kubectl,
    identity: OperatorIdentity,
    admin_kubeconfig: Path,
    path: Path,
    duration: str = "2h",
) -> Path:
    """Mint a token for the chart's ServiceAccount (`kubectl create token`) and write a
    kubeconfig that uses it: run kubectl, or the operator (KUBECONFIG=<path>), with exactly
    the chart's permissions."""
    token = kubectl("create", "token", identity.service_account, "-n", identity.namespace,
                    f"--duration={duration}").stdout.strip()
    return sa_kubeconfig(path, admin_kubeconfig, token)
